"""Every message that crosses a socket, as a plain dataclass.

Wire layout of one message (a ZeroMQ multipart message):

    frame 0      msgpack header {"type": tag, "v": version, "frames": [...], **fields}
    frame 1..n   raw payload bytes, one frame per entry of header["frames"]:
                 a tensor meta {"dtype", "shape"} (see codec.py) or an int byte
                 count for an opaque blob (image bytes)

Each class writes its fields explicitly in `_fields()` / `_payload()` and reads
them back with typed getters in `_build()`; `MESSAGE_TYPES` maps tag -> class.
`decode_message(frames)` raises `WireError` (and nothing else) for any bad
input: garbage, truncation, wrong types, wrong frame count, unknown tag/version.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from typing import Any, ClassVar, Sequence

import torch

from epd.transport.codec import Fields, WireError, as_buffer, decode_tensor, encode_tensor
from epd.transport.codec import pack_header, unpack_header
from epd.transport.mm_span import MMSpan

__all__ = [
    "WireError", "Message", "MMSpan", "EncodeRequest", "EncodeDone", "PrefillRequest",
    "KVTransfer", "KVAck", "TokenOutput", "WorkerStats", "Ready", "Abort", "Shutdown",
    "MESSAGE_TYPES", "decode_message",
]

Payload = torch.Tensor | bytes
_RESERVED = ("type", "v", "frames")


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
        msg = decode_message(frames)
        if not isinstance(msg, cls):
            raise WireError(f"expected {cls.TYPE}, got {msg.TYPE}")
        return msg


def decode_message(frames: Sequence[Any]) -> Message:
    """Decode a multipart message (bytes / memoryview / zmq.Frame) into its dataclass."""
    if not isinstance(frames, (list, tuple)) or not frames:
        raise WireError("empty message")
    header = unpack_header(frames[0])
    tag, version = header.get("type"), header.get("v")
    cls = MESSAGE_TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise WireError(f"unknown message type {tag!r:.80}")
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


def _spans(f: Fields, name: str) -> list[MMSpan]:
    items = f.list_of(name, list)
    try:
        return [MMSpan.from_list(item) for item in items]
    except ValueError as e:
        raise WireError(f"{f.tag}.{name}: {e}") from None


def _need(ok: bool, tag: str, what: str) -> None:
    if not ok:
        raise WireError(f"{tag}: {what}")


@dataclass
class EncodeRequest(Message):
    """API -> encoder: encode one image; send EncodeDone to the address `reply_to`
    (with the tensors when `with_tensors`: the prefill worker shares no cache dir)."""

    TYPE: ClassVar[str] = "encode_request"
    HAS_PAYLOAD: ClassVar[bool] = True
    request_id: str
    mm_hash: str
    image: bytes  # raw encoded file bytes (JPEG/PNG/...), its own frame
    reply_to: str
    with_tensors: bool = False

    def _fields(self):
        return {"request_id": self.request_id, "mm_hash": self.mm_hash, "reply_to": self.reply_to,
                "with_tensors": self.with_tensors}

    def _payload(self):
        return [self.image]

    @classmethod
    def _build(cls, f, payload):
        _need(len(payload) == 1 and isinstance(payload[0], bytes), cls.TYPE, "needs one image blob")
        return cls(f.str("request_id"), f.str("mm_hash"), payload[0], f.str("reply_to"),
                   f.bool("with_tensors"))


@dataclass
class EncodeDone(Message):
    """Encoder -> prefill: image `mm_hash` is in the cache (ok) or failed (error).

    Carries the tensors only when encoder and prefill share no cache dir:
    embeddings [n, hidden] and deepstack features, each also [n, hidden].
    """

    TYPE: ClassVar[str] = "encode_done"
    HAS_PAYLOAD: ClassVar[bool] = True
    request_id: str
    mm_hash: str
    ok: bool
    error: str | None = None
    embeddings: torch.Tensor | None = None
    deepstack: list[torch.Tensor] = field(default_factory=list)
    grid_thw: tuple[int, int, int] | None = None

    def _fields(self):
        grid = None if self.grid_thw is None else list(self.grid_thw)
        return {"request_id": self.request_id, "mm_hash": self.mm_hash, "ok": self.ok,
                "error": self.error, "grid_thw": grid}

    def _payload(self):
        if self.embeddings is None:
            if self.deepstack:
                raise ValueError("deepstack features without embeddings")
            return []
        return [self.embeddings, *self.deepstack]

    @classmethod
    def _build(cls, f, payload):
        _need(all(isinstance(p, torch.Tensor) for p in payload), cls.TYPE,
              "payload must be tensors")
        embeddings, deepstack = (payload[0], payload[1:]) if payload else (None, [])
        if embeddings is not None:
            _need(embeddings.ndim == 2, cls.TYPE, "embeddings must be [n, hidden]")
            _need(all(d.shape == embeddings.shape for d in deepstack), cls.TYPE,
                  "deepstack features must match embeddings' shape")
        return cls(f.str("request_id"), f.str("mm_hash"), f.bool("ok"), f.opt_str("error"),
                   embeddings, list(deepstack), f.grid("grid_thw"))


@dataclass
class PrefillRequest(Message):
    """API -> prefill worker: a whole request; images arrive via EncodeDone or the cache."""

    TYPE: ClassVar[str] = "prefill_request"
    request_id: str
    prompt_token_ids: list[int]
    mm_spans: list[MMSpan]
    sampling: dict[str, Any]  # SamplingParams as a plain dict
    eos_token_ids: list[int]
    decode_worker: str | None  # None: this worker decodes too (e-pd / aggregated)
    arrival_time_s: float  # time.time() at the API

    def _fields(self):
        return {"request_id": self.request_id, "prompt_token_ids": list(self.prompt_token_ids),
                "mm_spans": [s.to_list() for s in self.mm_spans], "sampling": self.sampling,
                "eos_token_ids": list(self.eos_token_ids), "decode_worker": self.decode_worker,
                "arrival_time_s": self.arrival_time_s}

    @classmethod
    def _build(cls, f, payload):
        return cls(f.str("request_id"), f.int_list("prompt_token_ids"), _spans(f, "mm_spans"),
                   f.plain_dict("sampling"), f.int_list("eos_token_ids"),
                   f.opt_str("decode_worker"), f.float("arrival_time_s"))


@dataclass
class KVTransfer(Message):
    """Prefill -> decode: a prefilled request and its KV blocks.

    Two frames for all layers at once (one gather + one copy on the sender):
    k_blocks and v_blocks, each [num_layers, num_blocks, block_size,
    num_kv_heads, head_dim], blocks in token order, covering every prompt token.
    """

    TYPE: ClassVar[str] = "kv_transfer"
    HAS_PAYLOAD: ClassVar[bool] = True
    request_id: str
    prompt_token_ids: list[int]
    first_token_id: int  # sampled by prefill; decode continues from here
    sampling: dict[str, Any]
    eos_token_ids: list[int]
    mm_spans: list[MMSpan]
    arrival_time_s: float
    k_blocks: torch.Tensor
    v_blocks: torch.Tensor
    reply_to: str = ""  # address of the prefill worker, for the KVAck

    @property
    def num_layers(self) -> int:
        return self.k_blocks.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.k_blocks.shape[1]

    def _fields(self):
        return {"request_id": self.request_id, "prompt_token_ids": list(self.prompt_token_ids),
                "first_token_id": self.first_token_id, "sampling": self.sampling,
                "eos_token_ids": list(self.eos_token_ids),
                "mm_spans": [s.to_list() for s in self.mm_spans],
                "arrival_time_s": self.arrival_time_s, "reply_to": self.reply_to}

    def _payload(self):
        return [self.k_blocks, self.v_blocks]

    @classmethod
    def _build(cls, f, payload):
        _need(len(payload) == 2 and all(isinstance(p, torch.Tensor) for p in payload),
              cls.TYPE, "needs k and v tensor frames")
        k, v = payload
        _need(k.ndim == 5 and k.shape == v.shape and k.dtype == v.dtype, cls.TYPE,
              "k/v must be equal [layers, blocks, block_size, kv_heads, head_dim]")
        prompt = f.int_list("prompt_token_ids")
        _need(k.shape[1] * k.shape[2] >= len(prompt), cls.TYPE, "KV blocks shorter than prompt")
        return cls(f.str("request_id"), prompt, f.int("first_token_id"), f.plain_dict("sampling"),
                   f.int_list("eos_token_ids"), _spans(f, "mm_spans"), f.float("arrival_time_s"),
                   k, v, f.str("reply_to"))


@dataclass
class KVAck(Message):
    """Decode -> prefill: KV of `request_id` landed (ok) or not; prefill may free its copy."""

    TYPE: ClassVar[str] = "kv_ack"
    request_id: str
    ok: bool
    error: str | None = None

    def _fields(self):
        return {"request_id": self.request_id, "ok": self.ok, "error": self.error}

    @classmethod
    def _build(cls, f, payload):
        return cls(f.str("request_id"), f.bool("ok"), f.opt_str("error"))


@dataclass
class TokenOutput(Message):
    """Worker -> API: new tokens of one request (a delta, not the whole text).

    `index` is the position of token_ids[0] in the request's output: the
    prefill worker sends token 0 and the decode worker the rest, over two
    pipes the API reads in turn, so a later delta can arrive first."""

    TYPE: ClassVar[str] = "token_output"
    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list | None = None  # plain lists, one entry per token
    error: str | None = None
    index: int = 0

    def _fields(self):
        return {"request_id": self.request_id, "token_ids": list(self.token_ids),
                "finished": self.finished, "finish_reason": self.finish_reason,
                "num_prompt_tokens": self.num_prompt_tokens,
                "num_cached_tokens": self.num_cached_tokens, "logprobs": self.logprobs,
                "error": self.error, "index": self.index}

    @classmethod
    def _build(cls, f, payload):
        return cls(f.str("request_id"), f.int_list("token_ids"), f.bool("finished"),
                   f.opt_str("finish_reason"), f.int("num_prompt_tokens"),
                   f.int("num_cached_tokens"), f.opt_list("logprobs"), f.opt_str("error"), f.int("index"))


@dataclass
class WorkerStats(Message):
    """Worker -> API, every few hundred ms: load for the router."""

    TYPE: ClassVar[str] = "worker_stats"
    worker_id: str
    role: str
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    queue_depth: int
    counters: dict[str, float] = field(default_factory=dict)

    def _fields(self):
        return {"worker_id": self.worker_id, "role": self.role, "num_running": self.num_running,
                "num_waiting": self.num_waiting, "num_free_blocks": self.num_free_blocks,
                "num_total_blocks": self.num_total_blocks, "queue_depth": self.queue_depth,
                "counters": self.counters}

    @classmethod
    def _build(cls, f, payload):
        return cls(f.str("worker_id"), f.str("role"), f.int("num_running"), f.int("num_waiting"),
                   f.int("num_free_blocks"), f.int("num_total_blocks"), f.int("queue_depth"),
                   f.float_dict("counters"))


@dataclass
class Ready(Message):
    """Worker -> API: started, sockets bound at `addresses` (name -> zmq address,
    plus "host" and "mm_cache_dir"). From an `epd worker` on another host this
    is also its registration."""

    TYPE: ClassVar[str] = "ready"
    worker_id: str
    role: str
    addresses: dict[str, str] = field(default_factory=dict)

    def _fields(self):
        return {"worker_id": self.worker_id, "role": self.role, "addresses": self.addresses}

    @classmethod
    def _build(cls, f, payload):
        return cls(f.str("worker_id"), f.str("role"), f.str_dict("addresses"))


@dataclass
class Abort(Message):
    """API -> worker: drop these requests and free their blocks."""

    TYPE: ClassVar[str] = "abort"
    request_ids: list[str]

    def _fields(self):
        return {"request_ids": list(self.request_ids)}

    @classmethod
    def _build(cls, f, payload):
        return cls(f.list_of("request_ids", str))


@dataclass
class Shutdown(Message):
    """Launcher -> worker: finish up and exit."""

    TYPE: ClassVar[str] = "shutdown"


# The one place a tag becomes a class.
MESSAGE_TYPES: dict[str, type[Message]] = {
    "encode_request": EncodeRequest,
    "encode_done": EncodeDone,
    "prefill_request": PrefillRequest,
    "kv_transfer": KVTransfer,
    "kv_ack": KVAck,
    "token_output": TokenOutput,
    "worker_stats": WorkerStats,
    "ready": Ready,
    "abort": Abort,
    "shutdown": Shutdown,
}
assert all(cls.TYPE == tag for tag, cls in MESSAGE_TYPES.items())
assert not any(f.name in _RESERVED for cls in MESSAGE_TYPES.values() for f in dataclass_fields(cls))
