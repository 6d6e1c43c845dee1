"""Byte-level codec shared by wire messages and the embedding cache.

Two things cross a socket or land in LMDB: a small msgpack header and raw
tensor bytes. A tensor travels as `(meta, buffer)` where meta is the plain
dict `{"dtype": "bfloat16", "shape": [n, hidden]}` (it goes inside a header)
and buffer is the tensor's bytes, C order, native (little-endian) byte order.

Anything wrong with bytes coming *in* raises `WireError` and nothing else.
Nothing here pickles.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import msgpack
import torch


class WireError(ValueError):
    """Malformed, truncated, unknown or foreign bytes on the wire or in the cache."""


# Explicit, closed set: a dtype name not here is a WireError on decode and a
# ValueError on encode. numpy has no bfloat16, so we never go through numpy
# dtypes: every tensor is viewed as raw uint8 bytes and reinterpreted by torch.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn,  # an fp8 KV cache's blocks (engine/attention/fp8_kv.py)
    "float8_e5m2": torch.float8_e5m2,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_NDIM = 16
MAX_DIM = 1 << 48  # keeps torch.empty() of a zero-size shape from overflowing


def encode_tensor(tensor: torch.Tensor) -> tuple[dict[str, Any], memoryview]:
    """Return `(meta, buffer)` for `tensor`.

    Zero-copy for a contiguous CPU tensor: the memoryview aliases the tensor's
    storage, so the caller must not mutate the tensor until it has been sent.
    A GPU or non-contiguous tensor is first copied to contiguous host memory.
    """
    name = _DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        raise ValueError(f"unsupported tensor dtype {tensor.dtype}")
    tensor = tensor.detach().cpu().contiguous()
    meta = {"dtype": name, "shape": list(tensor.shape)}
    # reshape(-1) is a view of a contiguous tensor; uint8 view reinterprets bytes.
    flat = tensor.reshape(-1).view(torch.uint8)
    return meta, memoryview(flat.numpy())


def tensor_nbytes(meta: dict[str, Any]) -> int:
    """Validate a tensor meta dict and return its byte length."""
    dtype, shape = _check_meta(meta)
    return math.prod(shape) * dtype.itemsize


def decode_tensor(meta: Any, buffer: Any) -> torch.Tensor:
    """Rebuild a tensor from `meta` and a bytes-like `buffer` (or zmq.Frame).

    Zero-copy when the buffer is writable (a zmq frame, a bytearray): the
    tensor keeps the buffer alive. A read-only buffer (bytes) is copied once,
    since torch tensors may not alias read-only memory.
    """
    dtype, shape = _check_meta(meta)
    view = as_buffer(buffer)
    expected = math.prod(shape) * dtype.itemsize
    if view.nbytes != expected:
        raise WireError(
            f"tensor {meta['dtype']}{shape} needs {expected} bytes, got {view.nbytes}"
        )
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    if view.readonly:
        view = memoryview(bytearray(view))
    return torch.frombuffer(view, dtype=dtype).reshape(shape)


def as_buffer(obj: Any) -> memoryview:
    """A flat byte memoryview of bytes / bytearray / memoryview / zmq.Frame."""
    if hasattr(obj, "buffer") and not isinstance(obj, memoryview):
        obj = obj.buffer  # zmq.Frame (received with copy=False)
    try:
        view = memoryview(obj)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
    except (TypeError, ValueError) as e:
        raise WireError(f"frame is not a contiguous bytes buffer: {type(obj).__name__}") from e
    return view


def pack_header(header: dict[str, Any]) -> bytes:
    """msgpack a header dict (str keys, plain values only)."""
    return msgpack.packb(header, use_bin_type=True)


def unpack_header(data: Any) -> dict[str, Any]:
    """Unpack a msgpack header; anything but a str-keyed dict is a WireError."""
    view = as_buffer(data)
    try:
        header = msgpack.unpackb(view, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises many types on garbage; all mean "bad bytes"
        raise WireError(f"header is not valid msgpack: {type(e).__name__}: {e}") from e
    if not isinstance(header, dict):
        raise WireError(f"header must be a map, got {type(header).__name__}")
    return header


class Fields:
    """Typed getters over a decoded header (or a map nested in one); any mismatch
    is a WireError naming the field."""

    def __init__(self, header: dict[str, Any], tag: str):
        self.header, self.tag = header, tag

    def _get(self, name: str, ok: Callable[[Any], bool], want: str) -> Any:
        if name not in self.header:
            raise WireError(f"{self.tag}: missing field {name!r}")
        value = self.header[name]
        if not ok(value):
            raise WireError(f"{self.tag}.{name}: expected {want}, got {value!r:.80}")
        return value

    def int(self, name: str) -> int:
        return self._get(name, lambda v: type(v) is int, "int")

    def opt_int(self, name: str) -> int | None:
        return self._get(name, lambda v: v is None or type(v) is int, "int or None")

    def float(self, name: str) -> float:
        return float(self._get(name, lambda v: type(v) in (int, float), "float"))

    def bool(self, name: str) -> bool:
        return self._get(name, lambda v: type(v) is bool, "bool")

    def str(self, name: str) -> str:
        return self._get(name, lambda v: type(v) is str, "str")

    def opt_str(self, name: str) -> str | None:
        return self._get(name, lambda v: v is None or type(v) is str, "str or None")

    def one_of(self, name: str, choices: tuple[str | None, ...]) -> str | None:
        return self._get(name, lambda v: v in choices and (v is None or type(v) is str), f"one of {choices}")

    def mm_hash(self, name: str) -> str:
        return self._get(name, Fields.is_mm_hash, "64 lowercase hex chars")

    def token_ids(self, name: str) -> list[int]:
        return self._get(name, lambda v: _is_int_list(v) and all(x >= 0 for x in v), "list of token ids >= 0")

    def list_of(self, name: str, kind: type) -> list:
        return self._get(name, lambda v: _is_list_of(v, kind), f"list[{kind.__name__}]")

    def opt_list(self, name: str) -> list | None:
        return self._get(name, lambda v: v is None or isinstance(v, list), "list or None")

    def map(self, name: str) -> Fields:
        """A nested map, read with the same getters; its errors name `tag.name.field`."""
        return Fields(self._get(name, lambda v: _is_str_map(v), "map with str keys"), f"{self.tag}.{name}")

    def opt_map(self, name: str) -> Fields | None:
        value = self._get(name, lambda v: v is None or _is_str_map(v), "map with str keys or None")
        return None if value is None else Fields(value, f"{self.tag}.{name}")

    def reject_unknown(self, known) -> None:
        """For nested maps whose keys are a closed set: any other key is a WireError."""
        unknown = sorted(set(self.header) - set(known))
        if unknown:
            raise WireError(f"{self.tag}: unknown fields {unknown!r:.80}")

    def grid(self, name: str) -> tuple[int, int, int] | None:
        value = self._get(name, lambda v: v is None or Fields.is_grid(v), "[t, h, w] or None")
        return None if value is None else tuple(value)

    @staticmethod
    def is_grid(v: Any) -> bool:
        """[t, h, w]: three non-negative ints."""
        return _is_int_list(v) and len(v) == 3 and all(x >= 0 for x in v)

    @staticmethod
    def is_mm_hash(v: Any) -> bool:
        """A content key as `mm_cache.mm_hash` writes it: 32 bytes as 64 lowercase hex chars."""
        return type(v) is str and len(v) == 64 and all(c in _HEX for c in v)


_HEX = frozenset("0123456789abcdef")


def _is_int_list(v: Any) -> bool:
    return isinstance(v, list) and all(type(x) is int for x in v)


def _is_list_of(v: Any, kind: type) -> bool:
    return isinstance(v, list) and all(type(x) is kind for x in v)


def _is_str_map(v: Any) -> bool:
    return isinstance(v, dict) and all(type(k) is str for k in v)


def _check_meta(meta: Any) -> tuple[torch.dtype, list[int]]:
    if not isinstance(meta, dict):
        raise WireError(f"tensor meta must be a map, got {type(meta).__name__}")
    name = meta.get("dtype")
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise WireError(f"unknown tensor dtype {name!r}")
    shape = meta.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_NDIM
        or not all(type(d) is int and 0 <= d <= MAX_DIM for d in shape)
    ):
        raise WireError(f"bad tensor shape {shape!r}")
    return dtype, shape
