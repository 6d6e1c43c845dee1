"""Every message that crosses a socket, as a plain dataclass.

Wire layout of one message (a ZeroMQ multipart message):

    frame 0      msgpack header {"type": tag, "v": version, "frames": [...], **fields}
    frame 1..n   raw payload bytes, one frame per entry of header["frames"]:
                 a tensor meta {"dtype", "shape"} (see codec.py) or an int byte
                 count for an opaque blob (image bytes)

Each class writes its fields explicitly in `_fields()` / `_payload()` and reads
them back with typed getters in `_build()`; `MESSAGE_TYPES` maps tag -> class.
Values nested in a message have explicit forms too: MMSpan and TokenLogprobs as
lists, SamplingParams and the worker counters as maps with a closed key set.
`decode_message(frames)` raises `WireError` (and nothing else) for any bad
input: garbage, truncation, wrong types, wrong frame count, unknown tag/version,
and fields that decode but no worker could use (an unknown sampling key, a
sampling value SamplingParams refuses, a non-hex mm_hash, a span outside the prompt).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from typing import Any, ClassVar, Sequence

import torch

from epd.transport.addresses import MAX_API_SERVERS, is_peer_address
from epd.transport.roles import Role
from epd.transport.codec import Fields, WireError, as_buffer, decode_tensor, encode_tensor
from epd.transport.codec import pack_header, unpack_header
from epd.transport.sampling import SamplingParams, TokenLogprobs
from epd.transport.wire_values import (CacheFaults, EncoderCounters, EngineCounters, logprobs_from_list, logprobs_to_list,
                                       sampling_from_map, sampling_to_map)
from epd.transport.mm_span import MMSpan

__all__ = [
    "WireError", "Message", "MMSpan", "EncodeRequest", "EncodeDone", "PrefillRequest",
    "KVTransfer", "KVAck", "TokenOutput", "TokenOutputs", "WorkerStats", "Ready", "Abort", "Shutdown",
    "WorkerExited", "Alive",
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


def _spans(f: Fields, name: str, num_prompt_tokens: int) -> list[MMSpan]:
    """Image spans, each a run of placeholder tokens inside the prompt, keyed by a real mm_hash."""
    items = f.list_of(name, list)
    try:
        spans = [MMSpan.from_list(item) for item in items]
    except ValueError as e:
        raise WireError(f"{f.tag}.{name}: {e}") from None
    for s in spans:
        _need(Fields.is_mm_hash(s.mm_hash), f.tag, f"{name}: mm_hash must be 64 hex chars, got {s.mm_hash!r:.80}")
        _need(s.offset >= 0 and s.length >= 1 and s.offset + s.length <= num_prompt_tokens, f.tag,
              f"{name}: span [{s.offset}, +{s.length}) outside the prompt of {num_prompt_tokens} tokens")
    return spans


def _api_index(f: Fields) -> int:
    index = f.int("api_index")
    _need(0 <= index < MAX_API_SERVERS, f.tag, f"api_index must be in [0, {MAX_API_SERVERS}), got {index}")
    return index


def _address(f: Fields, name: str, optional: bool = False) -> str | None:
    """An address we may connect to (transport/addresses.py `is_peer_address`); `optional`: None or "" too."""
    value = f.opt_str(name) if optional else f.str(name)
    _need((optional and not value) or is_peer_address(value), f.tag,
          f"{name}: not an address to connect to: {value!r:.80}")
    return value


SESSION_HEX_CHARS = 32  # a worker process's session token (WorkerIO): 128 random bits


def _session(f: Fields) -> str:
    """The sender's session token: "" or hex, at most 64 characters."""
    value = f.str("session")
    _need(len(value) <= 64 and all(c in "0123456789abcdef" for c in value), f.tag,
          f"session: expected hex, got {value!r:.80}")
    return value


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
        return cls(f.str("request_id"), f.mm_hash("mm_hash"), payload[0], _address(f, "reply_to"),
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
        return cls(f.str("request_id"), f.mm_hash("mm_hash"), f.bool("ok"), f.opt_str("error"),
                   embeddings, list(deepstack), f.grid("grid_thw"))


@dataclass
class PrefillRequest(Message):
    """API -> prefill worker: a whole request; images arrive via EncodeDone or the cache."""

    TYPE: ClassVar[str] = "prefill_request"
    request_id: str
    prompt_token_ids: list[int]
    mm_spans: list[MMSpan]
    sampling: SamplingParams  # n == 1: the API fans n > 1 out into requests
    eos_token_ids: list[int]
    decode_worker: str | None  # None: this worker decodes too (e-pd / aggregated)
    api_index: int = 0  # which API process's collector (WorkerSpec.apis) takes its TokenOutputs

    def _fields(self):
        return {"request_id": self.request_id, "prompt_token_ids": list(self.prompt_token_ids),
                "mm_spans": [s.to_list() for s in self.mm_spans], "sampling": sampling_to_map(self.sampling),
                "eos_token_ids": list(self.eos_token_ids), "decode_worker": self.decode_worker,
                "api_index": self.api_index}

    @classmethod
    def _build(cls, f, payload):
        prompt = f.token_ids("prompt_token_ids")
        return cls(f.str("request_id"), prompt, _spans(f, "mm_spans", len(prompt)),
                   sampling_from_map(f.map("sampling")), f.token_ids("eos_token_ids"),
                   _address(f, "decode_worker", optional=True), _api_index(f))


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
    sampling: SamplingParams
    eos_token_ids: list[int]
    mm_spans: list[MMSpan]
    k_blocks: torch.Tensor
    v_blocks: torch.Tensor
    reply_to: str = ""  # address of the prefill worker, for the KVAck
    api_index: int = 0  # the PrefillRequest's: where the decode worker sends the TokenOutputs

    @property
    def num_layers(self) -> int:
        return self.k_blocks.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.k_blocks.shape[1]

    def _fields(self):
        return {"request_id": self.request_id, "prompt_token_ids": list(self.prompt_token_ids),
                "first_token_id": self.first_token_id, "sampling": sampling_to_map(self.sampling),
                "eos_token_ids": list(self.eos_token_ids),
                "mm_spans": [s.to_list() for s in self.mm_spans], "reply_to": self.reply_to,
                "api_index": self.api_index}

    def _payload(self):
        return [self.k_blocks, self.v_blocks]

    @classmethod
    def _build(cls, f, payload):
        _need(len(payload) == 2 and all(isinstance(p, torch.Tensor) for p in payload),
              cls.TYPE, "needs k and v tensor frames")
        k, v = payload
        _need(k.ndim == 5 and k.shape == v.shape and k.dtype == v.dtype, cls.TYPE,
              "k/v must be equal [layers, blocks, block_size, kv_heads, head_dim]")
        prompt = f.token_ids("prompt_token_ids")
        _need(k.shape[1] * k.shape[2] >= len(prompt), cls.TYPE, "KV blocks shorter than prompt")
        first_token_id = f.int("first_token_id")
        _need(first_token_id >= 0, cls.TYPE, "first_token_id must be a token id >= 0")
        return cls(f.str("request_id"), prompt, first_token_id, sampling_from_map(f.map("sampling")),
                   f.token_ids("eos_token_ids"), _spans(f, "mm_spans", len(prompt)), k, v,
                   _address(f, "reply_to", optional=True) or "", _api_index(f))


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


FINISH_REASONS = (None, "stop", "length", "abort", "error")


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
    finish_reason: str | None = None  # one of FINISH_REASONS
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None  # one per token of token_ids, when asked
    error: str | None = None
    index: int = 0
    is_internal_error: bool = False  # the worker's fault, not the request's: the API may retry it

    def _fields(self):
        return {"request_id": self.request_id, "token_ids": list(self.token_ids),
                "finished": self.finished, "finish_reason": self.finish_reason,
                "num_prompt_tokens": self.num_prompt_tokens,
                "num_cached_tokens": self.num_cached_tokens, "logprobs": logprobs_to_list(self.logprobs),
                "error": self.error, "index": self.index, "is_internal_error": self.is_internal_error}

    @classmethod
    def _build(cls, f, payload):
        token_ids, logprobs = f.token_ids("token_ids"), f.opt_list("logprobs")
        if logprobs is not None:
            _need(len(logprobs) == len(token_ids), cls.TYPE, "logprobs: one entry per token")
            logprobs = logprobs_from_list(logprobs, f"{cls.TYPE}.logprobs")
        return cls(f.str("request_id"), token_ids, f.bool("finished"),
                   f.one_of("finish_reason", FINISH_REASONS), f.int("num_prompt_tokens"),
                   f.int("num_cached_tokens"), logprobs, f.opt_str("error"), f.int("index"),
                   f.bool("is_internal_error"))


# TokenOutput's fields in the order of its list form (TokenOutputs' entries).
_TOKEN_OUTPUT_KEYS = ("request_id", "token_ids", "finished", "finish_reason", "num_prompt_tokens",
                      "num_cached_tokens", "logprobs", "error", "index", "is_internal_error")


@dataclass
class TokenOutputs(Message):
    """Worker -> API, once per engine step: every TokenOutput of the step bound
    for one API process, in the order the step made them.

    Each entry is a TokenOutput as a 10-item list, its fields in the order of
    `_TOKEN_OUTPUT_KEYS`, checked as TokenOutput's own fields are. A step of
    128 streams is one message (one receive, one header decode on the API's
    event loop) instead of 128. A worker still sends a lone TokenOutput for an
    output outside a step (a request that failed on admission)."""

    TYPE: ClassVar[str] = "token_outputs"
    outputs: list[TokenOutput]

    def _fields(self):
        return {"outputs": [[o.request_id, list(o.token_ids), o.finished, o.finish_reason, o.num_prompt_tokens,
                             o.num_cached_tokens, logprobs_to_list(o.logprobs), o.error, o.index,
                             o.is_internal_error] for o in self.outputs]}

    @classmethod
    def _build(cls, f, payload):
        entries = f.list_of("outputs", list)
        outputs = []
        for i, entry in enumerate(entries):
            _need(len(entry) == len(_TOKEN_OUTPUT_KEYS), cls.TYPE,
                  f"outputs[{i}]: {len(_TOKEN_OUTPUT_KEYS)} items, got {len(entry)}")
            out = _plain_output(entry)
            if out is None:  # logprobs, or a bad field: TokenOutput's own checks (which name the field)
                out = TokenOutput._build(Fields(dict(zip(_TOKEN_OUTPUT_KEYS, entry)), f"{cls.TYPE}[{i}]"), [])
            outputs.append(out)
        return cls(outputs)


def _plain_output(entry: list) -> TokenOutput | None:
    """The common entry (no logprobs, every field well typed) checked inline, a few
    us cheaper than the named getters per output; None for anything else."""
    request_id, token_ids, finished, finish_reason, num_prompt_tokens, num_cached_tokens, logprobs, error, index, \
        is_internal_error = entry
    if (logprobs is None and type(request_id) is str and type(token_ids) is list
            and all(type(t) is int and t >= 0 for t in token_ids) and type(finished) is bool
            and (finish_reason is None or type(finish_reason) is str and finish_reason in FINISH_REASONS)
            and type(num_prompt_tokens) is int and type(num_cached_tokens) is int
            and (error is None or type(error) is str) and type(index) is int and type(is_internal_error) is bool):
        return TokenOutput(request_id, token_ids, finished, finish_reason, num_prompt_tokens, num_cached_tokens,
                           None, error, index, is_internal_error)
    return None


@dataclass
class WorkerStats(Message):
    """Worker -> API, every few hundred ms: load for the router, counters for /metrics."""

    TYPE: ClassVar[str] = "worker_stats"
    VERSION: ClassVar[int] = 3  # 2: session, 3: cache
    worker_id: str
    role: str
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    queue_depth: int
    engine: EngineCounters | None = None  # engine roles
    encoder: EncoderCounters | None = None  # encoders, and the aggregated worker's in-process one
    session: str = ""  # the sender's session token (its Ready's): the registry takes stats only from it
    cache: CacheFaults | None = None  # its embedding cache's faults; None: it has no cache

    def _fields(self):
        return {"worker_id": self.worker_id, "role": self.role, "num_running": self.num_running,
                "num_waiting": self.num_waiting, "num_free_blocks": self.num_free_blocks,
                "num_total_blocks": self.num_total_blocks, "queue_depth": self.queue_depth,
                "engine": None if self.engine is None else self.engine.to_map(),
                "encoder": None if self.encoder is None else self.encoder.to_map(), "session": self.session,
                "cache": None if self.cache is None else self.cache.to_map()}

    @classmethod
    def _build(cls, f, payload):
        engine, encoder, cache = f.opt_map("engine"), f.opt_map("encoder"), f.opt_map("cache")
        counts = [f.int(name) for name in ("num_running", "num_waiting", "num_free_blocks", "num_total_blocks",
                                            "queue_depth")]
        _need(all(0 <= n < 2 ** 40 for n in counts), cls.TYPE, f"counts must be in [0, 2^40), got {counts}")
        return cls(f.str("worker_id"), f.one_of("role", tuple(Role)), *counts,
                   None if engine is None else EngineCounters.from_map(engine),
                   None if encoder is None else EncoderCounters.from_map(encoder), _session(f),
                   None if cache is None else CacheFaults.from_map(cache))


@dataclass
class Ready(Message):
    """Worker -> API: started, inbox bound. From an `epd worker` on another host
    this is also its registration."""

    TYPE: ClassVar[str] = "ready"
    VERSION: ClassVar[int] = 2  # 2: session
    worker_id: str
    role: str
    inbox: str  # the address its inbox is bound at
    host: str  # its socket.gethostname(): a cache dir is shared only on the same host
    mm_cache_dir: str | None = None  # the embedding cache it reads and writes; None: none
    # A secret of this worker process, drawn at its start: a worker id held by a live
    # worker is taken over, and its stats believed, only with the same session.
    session: str = ""

    def _fields(self):
        return {"worker_id": self.worker_id, "role": self.role, "inbox": self.inbox, "host": self.host,
                "mm_cache_dir": self.mm_cache_dir, "session": self.session}

    @classmethod
    def _build(cls, f, payload):
        return cls(f.str("worker_id"), f.one_of("role", tuple(Role)), _address(f, "inbox"), f.str("host"),
                   f.opt_str("mm_cache_dir"), _session(f))


@dataclass
class Alive(Message):
    """Worker -> API, from the worker's heartbeat thread while its loop is busy
    (a long ViT batch or prefill step sends no WorkerStats): the process is up.
    `busy_s`: how long its loop has not come back (since its last WorkerStats)."""

    TYPE: ClassVar[str] = "alive"
    VERSION: ClassVar[int] = 2  # 2: session
    worker_id: str
    busy_s: float
    session: str = ""  # as in its Ready

    def _fields(self):
        return {"worker_id": self.worker_id, "busy_s": float(self.busy_s), "session": self.session}

    @classmethod
    def _build(cls, f, payload):
        busy_s = f.float("busy_s")
        _need(0.0 <= busy_s < 1e9, cls.TYPE, f"busy_s must be finite seconds >= 0, got {busy_s!r}")
        return cls(f.str("worker_id"), busy_s, _session(f))


@dataclass
class WorkerExited(Message):
    """Launcher -> every API process (`--api-servers` > 1, whose workers are not
    its own children): the supervisor saw this worker's process exit."""

    TYPE: ClassVar[str] = "worker_exited"
    VERSION: ClassVar[int] = 2  # 2: restarting
    worker_id: str
    exit_code: int | None
    restarting: bool = True  # False: the supervisor gave up on it (for now): its role may be down

    def _fields(self):
        return {"worker_id": self.worker_id, "exit_code": self.exit_code, "restarting": self.restarting}

    @classmethod
    def _build(cls, f, payload):
        return cls(f.str("worker_id"), f.opt_int("exit_code"), f.bool("restarting"))


@dataclass
class Abort(Message):
    """API -> worker: drop these requests and free their blocks. Launcher ->
    worker, `api_index` set: API process `api_index` exited, drop all of its requests too."""

    TYPE: ClassVar[str] = "abort"
    request_ids: list[str]
    api_index: int | None = None

    def _fields(self):
        return {"request_ids": list(self.request_ids), "api_index": self.api_index}

    @classmethod
    def _build(cls, f, payload):
        return cls(f.list_of("request_ids", str), None if f.opt_int("api_index") is None else _api_index(f))


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
    "token_outputs": TokenOutputs,
    "worker_stats": WorkerStats,
    "ready": Ready,
    "abort": Abort,
    "shutdown": Shutdown,
    "worker_exited": WorkerExited,
    "alive": Alive,
}
assert all(cls.TYPE == tag for tag, cls in MESSAGE_TYPES.items())
assert not any(f.name in _RESERVED for cls in MESSAGE_TYPES.values() for f in dataclass_fields(cls))
