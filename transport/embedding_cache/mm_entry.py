"""One cached image: its embeddings and the bytes format they are stored in.

Value layout (little-endian), tensors 64-byte aligned within the value:

    b"EPDMM\\x00v1"  8-byte magic
    u32             header length
    header          msgpack {"v", "fingerprint", "grid_thw", "created_s", "tensors": [meta...]}
    pad, tensor 0 (embeddings [n, hidden]), pad, tensor 1.. (deepstack, each [n, hidden])

Offsets are not stored: they follow from the header, and the value must end
exactly where the last tensor does, so truncation or padding is detected.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from typing import Any

import torch

from epd.transport.wire.codec import Fields, WireError, decode_tensor, encode_tensor, pack_header
from epd.transport.wire.codec import tensor_nbytes, unpack_header

MAGIC = b"EPDMM\x00v1"
FORMAT_VERSION = 1
_ALIGN = 64
_PREFIX = struct.Struct("<8sI")  # magic, header length


@dataclass
class MMEntry:
    """Vision-tower output for one image, as the language model consumes it.

    The one type for it in every layer: the encoder returns it, the cache
    stores it, EncodeDone carries its tensors and the engine's runner merges
    it at the image's placeholder tokens.
    """

    embeddings: torch.Tensor  # [n, hidden], n = placeholder tokens of the image
    deepstack: list[torch.Tensor]  # each [n, hidden]; [] for models without deepstack
    grid_thw: tuple[int, int, int]  # patch grid before spatial merge
    created_s: float = 0.0  # time.time() when first written; set by `encode_entry`


def _align(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def encode_entry(entry: MMEntry, model_fingerprint: str) -> bytes:
    """Serialize `entry` into one cache value (one copy of the tensor bytes)."""
    if entry.embeddings.ndim != 2:
        raise ValueError(f"embeddings must be [n, hidden], got {list(entry.embeddings.shape)}")
    if any(d.shape != entry.embeddings.shape for d in entry.deepstack):
        raise ValueError("deepstack features must match the embeddings' shape")
    parts = [encode_tensor(t) for t in (entry.embeddings, *entry.deepstack)]
    header = pack_header({
        "v": FORMAT_VERSION,
        "fingerprint": model_fingerprint,
        "grid_thw": list(entry.grid_thw),
        "created_s": entry.created_s or time.time(),
        "tensors": [meta for meta, _ in parts],
    })
    offsets, end = [], _PREFIX.size + len(header)
    for _, buf in parts:
        offsets.append(_align(end))
        end = offsets[-1] + buf.nbytes
    value = bytearray(end)
    _PREFIX.pack_into(value, 0, MAGIC, len(header))
    value[_PREFIX.size:_PREFIX.size + len(header)] = header
    for offset, (_, buf) in zip(offsets, parts):
        value[offset:offset + buf.nbytes] = buf
    return bytes(value)


def read_header(value: Any, model_fingerprint: str) -> tuple[dict[str, Any], list[int], int]:
    """Validate a value's framing; return (header, tensor offsets, end). WireError if bad."""
    view = memoryview(value)
    if view.nbytes < _PREFIX.size:
        raise WireError(f"cache value too short ({view.nbytes} bytes)")
    magic, header_len = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise WireError("bad cache value magic")
    if _PREFIX.size + header_len > view.nbytes:
        raise WireError("truncated cache value header")
    header = unpack_header(view[_PREFIX.size:_PREFIX.size + header_len])
    f = Fields(header, "mm_entry")
    if f.int("v") != FORMAT_VERSION:
        raise WireError(f"cache value format v{header['v']}, want v{FORMAT_VERSION}")
    if f.str("fingerprint") != model_fingerprint:
        raise WireError("cache value written for another model")
    metas = f.list_of("tensors", dict)
    if not metas:
        raise WireError("cache value holds no tensors")
    offsets, end = [], _PREFIX.size + header_len
    for meta in metas:
        offsets.append(_align(end))
        end = offsets[-1] + tensor_nbytes(meta)
    if end != view.nbytes:
        raise WireError(f"cache value is {view.nbytes} bytes, header implies {end}")
    return header, offsets, end


def decode_entry(value: Any, model_fingerprint: str) -> MMEntry:
    """Parse a cache value; WireError if corrupt, truncated or foreign.

    Copies the tensor bytes once out of `value` (an LMDB map view is only
    valid inside its read transaction); the tensors then share that copy.
    """
    header, offsets, end = read_header(value, model_fingerprint)
    f = Fields(header, "mm_entry")
    grid = f.grid("grid_thw")
    if grid is None:
        raise WireError("cache value has no grid_thw")
    base = offsets[0]
    blob = memoryview(bytearray(memoryview(value)[base:end]))  # the one copy
    tensors = []
    for meta, offset in zip(header["tensors"], offsets):
        start = offset - base
        tensors.append(decode_tensor(meta, blob[start:start + tensor_nbytes(meta)]))
    embeddings, deepstack = tensors[0], tensors[1:]
    if embeddings.ndim != 2 or any(d.shape != embeddings.shape for d in deepstack):
        raise WireError("cache value tensors are not [n, hidden]")
    return MMEntry(embeddings, deepstack, grid, f.float("created_s"))

