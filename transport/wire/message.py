"""The base of every wire message, how one is framed, and the checks fields share.

Wire layout of one message (a ZeroMQ multipart message):

    frame 0      msgpack header {"type": tag, "v": version, "frames": [...], **fields}
    frame 1..n   raw payload bytes, one frame per entry of header["frames"]:
                 a tensor meta {"dtype", "shape"} (see codec.py) or an int byte
                 count for an opaque blob (image bytes)

Each class writes its fields explicitly in `_fields()` / `_payload()` and reads
them back with typed getters in `_build()`. The classes are in
transport/wire/request_messages.py (a request's way through the workers) and
transport/wire/control_messages.py (the worker plane's control); transport/wire/messages.py
maps tag -> class and decodes any message.
"""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import torch

from epd.transport.wire.addresses import MAX_API_SERVERS, is_peer_address
from epd.transport.wire.codec import Fields, WireError, as_buffer, decode_tensor, encode_tensor
from epd.transport.wire.codec import pack_header, unpack_header

Payload = torch.Tensor | bytes
RESERVED = ("type", "v", "frames")  # header keys no message field may take


class Message:
    """Base of all wire messages: `to_wire()` -> frames, `from_wire(frames)` -> message."""

    TYPE: ClassVar[str]
    VERSION: ClassVar[int] = 1
    HAS_PAYLOAD: ClassVar[bool] = False  # False: any payload frame is a WireError

    def _fields(self) -> dict[str, Any]:
        return {}

    def _payload(self) -> list[Payload]:
        return []

    @classmethod
    def _build(cls, f: Fields, payload: list) -> Message:
        return cls()

    def to_wire(self) -> list[bytes | memoryview]:
        """Frames for `send_multipart(..., copy=False)`; tensor frames alias tensor memory."""
        metas, buffers = [], []
        for item in self._payload():
            if isinstance(item, torch.Tensor):
                meta, buf = encode_tensor(item)
            else:
                buf = as_buffer(item)
                meta = buf.nbytes
            metas.append(meta)
            buffers.append(buf)
        header = {"type": self.TYPE, "v": self.VERSION, "frames": metas, **self._fields()}
        return [pack_header(header), *buffers]

    @classmethod
    def from_wire(cls, frames: Sequence[Any]) -> Message:
        """Decode frames expected to hold a `cls`; anything else is a WireError."""
        header = header_of(frames)
        tag = header.get("type")
        if tag != cls.TYPE:
            raise WireError(f"expected {cls.TYPE}, got {tag!r:.80}")
        return decode_as(cls, header, frames)


def header_of(frames: Sequence[Any]) -> dict:
    """Frame 0's header of a multipart message (bytes / memoryview / zmq.Frame)."""
    if not isinstance(frames, (list, tuple)) or not frames:
        raise WireError("empty message")
    return unpack_header(frames[0])


def decode_as(cls: type[Message], header: dict, frames: Sequence[Any]) -> Message:
    """The `cls` message of `frames`, whose header is `header`: version, payload frames, fields checked."""
    tag, version = header.get("type"), header.get("v")
    if version != cls.VERSION or type(version) is not int:
        raise WireError(f"{tag}: unsupported version {version!r:.80} (want {cls.VERSION})")
    metas = header.get("frames")
    if not isinstance(metas, list) or len(frames) != 1 + len(metas):
        count = len(metas) if isinstance(metas, list) else "?"
        raise WireError(f"{tag}: header announces {count} payload frames, got {len(frames) - 1}")
    if metas and not cls.HAS_PAYLOAD:
        raise WireError(f"{tag}: takes no payload frames, got {len(metas)}")
    payload: list[Payload] = []
    for meta, frame in zip(metas, frames[1:]):
        if type(meta) is int:
            view = as_buffer(frame)
            if view.nbytes != meta:
                raise WireError(f"{tag}: blob of {meta} bytes, frame has {view.nbytes}")
            payload.append(bytes(view))
        else:
            payload.append(decode_tensor(meta, frame))
    return cls._build(Fields(header, tag), payload)


def read_api_index(f: Fields) -> int:
    index = f.int("api_index")
    need(0 <= index < MAX_API_SERVERS, f.tag, f"api_index must be in [0, {MAX_API_SERVERS}), got {index}")
    return index


def read_address(f: Fields, name: str, optional: bool = False) -> str | None:
    """An address we may connect to (transport/wire/addresses.py `is_peer_address`); `optional`: None or "" too."""
    value = f.opt_str(name) if optional else f.str(name)
    need((optional and not value) or is_peer_address(value), f.tag,
         f"{name}: not an address to connect to: {value!r:.80}")
    return value


def need(ok: bool, tag: str, what: str) -> None:
    if not ok:
        raise WireError(f"{tag}: {what}")
