"""One cached item: its embeddings, named extras, and the bytes format they are stored in.

Value layout (little-endian), tensors 64-byte aligned within the value:

    b"EPDMM\\x00v1"  8-byte magic
    u32             header length
    header          msgpack {"v": 2, "fingerprint", "meta", "extras": [name...], "created_s",
                             "tensors": [tensor meta...]}
    pad, tensor 0 (embeddings [n, hidden]), pad, tensor 1.. (the extras in `extras`' order, each [n, ...])

Format 2 (named extras, the item's family metadata in "meta"); a value of
another format reads as a miss, as a corrupt one does, so an old cache is
never misread.

Offsets are not stored: they follow from the header, and the value must end
exactly where the last tensor does, so truncation or padding is detected.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from epd.transport.wire.codec import Fields, WireError, decode_tensor, encode_tensor, pack_header
from epd.transport.wire.codec import tensor_nbytes, unpack_header
from epd.transport.wire.mm_span import MetaValue, meta_from_wire, meta_to_wire

MAGIC = b"EPDMM\x00v1"
FORMAT_VERSION = 2  # 1: a family's extras and grid as fields of their own
_ALIGN = 64
_PREFIX = struct.Struct("<8sI")  # magic, header length


@dataclass
class MMEntry:
    """Vision-tower output for one item, as the language model consumes it.

    The one type for it in every layer: the encoder returns it, the cache
    stores it, EncodeDone carries its tensors and the engine's runner merges
    it at the item's placeholder tokens. `extras` are what a family's language
    model takes beside the embeddings, row i of each belonging to placeholder
    token i (a family's model names its own: engine/models/); `meta` the
    family's metadata of the item, as its span carries it (mm_span.py).
    """

    embeddings: torch.Tensor  # [n, hidden], n = placeholder tokens of the item
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [n, ...]
    meta: dict[str, MetaValue] = field(default_factory=dict)
    created_s: float = 0.0  # time.time() when first written; set by `encode_entry`


def _align(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def encode_entry(entry: MMEntry, model_fingerprint: str) -> bytes:
    """Serialize `entry` into one cache value (one copy of the tensor bytes)."""
    if entry.embeddings.ndim != 2:
        raise ValueError(f"embeddings must be [n, hidden], got {list(entry.embeddings.shape)}")
    if any(x.ndim < 1 or x.shape[0] != entry.embeddings.shape[0] for x in entry.extras.values()):
        raise ValueError("extras must be [n, ...], a row per embedding row")
    parts = [encode_tensor(t) for t in (entry.embeddings, *entry.extras.values())]
    header = pack_header({
        "v": FORMAT_VERSION,
        "fingerprint": model_fingerprint,
        "meta": meta_to_wire(entry.meta),
        "extras": list(entry.extras),
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
    names = f.list_of("extras", str)
    if len(set(names)) != len(names) or len(names) != len(offsets) - 1:
        raise WireError("cache value extras: one distinct name per tensor after the embeddings")
    try:
        meta = meta_from_wire(f.map("meta").header)
    except ValueError as e:
        raise WireError(f"cache value: {e}") from None
    base = offsets[0]
    blob = memoryview(bytearray(memoryview(value)[base:end]))  # the one copy
    tensors = []
    for tensor_meta, offset in zip(header["tensors"], offsets):
        start = offset - base
        tensors.append(decode_tensor(tensor_meta, blob[start:start + tensor_nbytes(tensor_meta)]))
    embeddings, extras = tensors[0], tensors[1:]
    if embeddings.ndim != 2 or any(x.ndim < 1 or x.shape[0] != embeddings.shape[0] for x in extras):
        raise WireError("cache value tensors are not [n, hidden] and extras [n, ...]")
    return MMEntry(embeddings, dict(zip(names, extras)), meta, f.float("created_s"))

