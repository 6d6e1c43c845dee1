"""A KV block's prefix-cache hash: one implementation for the block manager (which
registers and looks up blocks by it) and the API's cache-aware router (which
computes a request's hashes to find the worker holding its longest prefix,
epd/serve/prefix_index.py). Pure Python, no torch: the API process imports it.

    root_block_hash(lora_key)       the parent of a prompt's first block
    hash_block(parent, tokens, ...) one full block, chained on its parent
    prompt_block_hashes(...)        a prompt's first full blocks, chained
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgpack

from epd.transport.wire.mm_span import MMSpan

# Parent hash of a prompt's first block: any fixed value works, it only has to
# differ from every real digest.
ROOT_BLOCK_HASH = b"\x00" * 32


def hash_block(parent_block_hash: bytes, token_ids: Sequence[int], block_start: int,
               mm_spans: Sequence[MMSpan]) -> bytes:
    """Chained hash of one full block.

    Covers the parent block's hash (so equal blocks match only after equal
    prefixes, and with the same adapter: `root_block_hash`), the block's token ids, and for every image span overlapping
    the block its `mm_hash` plus the overlap range as rows of the item's entry
    (`MMSpan.first_row` on): all images share one placeholder token id, so token ids
    alone would let the same text with a different image match.
    """
    block_end = block_start + len(token_ids)
    mm_keys = [[span.mm_hash, span.first_row + max(span.offset, block_start) - span.offset,
                span.first_row + min(span.end, block_end) - span.offset]
               for span in mm_spans if span.offset < block_end and span.end > block_start]
    # msgpack of ints/strings is byte-stable across processes (Python's hash() is not).
    payload = msgpack.packb([list(token_ids), mm_keys])
    return hashlib.sha256(parent_block_hash + payload).digest()


def root_block_hash(lora_key: tuple[str, str, str | None] | None) -> bytes:
    """The parent hash of a prompt's first block: the fixed root for the base
    model, one derived from the adapter's name, path and the digest of the files
    the worker read (`Request.lora_key`) otherwise, so no block computed with one
    adapter (or none, or its weights before a retraining in place) ever matches a
    request with another."""
    if lora_key is None:
        return ROOT_BLOCK_HASH
    return hashlib.sha256(b"lora" + msgpack.packb(list(lora_key))).digest()


def prompt_block_hashes(token_ids: Sequence[int], mm_spans: Sequence[MMSpan], block_size: int,
                        num_blocks: int, root: bytes = ROOT_BLOCK_HASH,
                        done: Sequence[bytes] = ()) -> list[bytes]:
    """The chained hashes of the first `num_blocks` full blocks of `token_ids`;
    `done`: the first ones, already computed (extended, not recomputed)."""
    block_hashes = list(done)
    for i in range(len(block_hashes), num_blocks):
        start = i * block_size
        parent = block_hashes[-1] if block_hashes else root
        block_hashes.append(hash_block(parent, token_ids[start:start + block_size], start, mm_spans))
    return block_hashes
