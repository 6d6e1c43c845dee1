"""The messages of a request's way through the workers: API -> encoder ->
prefill -> decode -> API (transport/wire/message.py frames them; the table of
every tag is in transport/wire/messages.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from epd.transport.wire.codec import Fields, WireError
from epd.transport.wire.lora_request import LoRARequest
from epd.transport.wire.message import Message, need, read_address, read_api_index
from epd.transport.wire.mm_span import MetaValue, MMSpan, meta_from_wire, meta_to_wire
from epd.transport.media.video_geometry import VideoPlan
from epd.transport.media.video_plan_fields import video_from_fields, video_to_map
from epd.transport.wire.sampling import SamplingParams, TokenLogprobs
from epd.transport.wire.wire_values import logprobs_from_list, logprobs_to_list, sampling_from_map, sampling_to_map


def _spans(f: Fields, name: str, num_prompt_tokens: int) -> list[MMSpan]:
    """Image spans, each a run of placeholder tokens inside the prompt, keyed by a real mm_hash."""
    items = f.list_of(name, list)
    try:
        spans = [MMSpan.from_list(item) for item in items]
    except ValueError as e:
        raise WireError(f"{f.tag}.{name}: {e}") from None
    for s in spans:
        need(Fields.is_mm_hash(s.mm_hash), f.tag, f"{name}: mm_hash must be 64 hex chars, got {s.mm_hash!r:.80}")
        need(s.offset >= 0 and s.length >= 1 and s.offset + s.length <= num_prompt_tokens, f.tag,
             f"{name}: span [{s.offset}, +{s.length}) outside the prompt of {num_prompt_tokens} tokens")
    return spans


def _lora_to_wire(lora: LoRARequest | None) -> list | None:
    return None if lora is None else lora.to_list()


def _lora(f: Fields, name: str) -> LoRARequest | None:
    """The request's adapter: None or [name, id, path] with a positive id and a path."""
    value = f.opt_list(name)
    try:
        return None if value is None else LoRARequest.from_list(value)
    except ValueError as e:
        raise WireError(f"{f.tag}.{name}: {e}") from None


@dataclass
class EncodeRequest(Message):
    """API -> encoder: encode one image, one video when `video` is set (the
    frames and size the API counted), or one audio clip when `audio_tokens` is
    (the placeholder tokens the API counted, which its embeddings must fill); send EncodeDone to the address `reply_to`
    (with the tensors when `with_tensors`: the prefill worker shares no cache dir).
    `alone`: encode it in a batch of its own (its request was among several
    suspects of an encoder's death: alone, a second death names it)."""

    TYPE: ClassVar[str] = "encode_request"
    VERSION: ClassVar[int] = 3  # 2: alone; 3: audio_tokens
    HAS_PAYLOAD: ClassVar[bool] = True
    request_id: str
    mm_hash: str
    image: bytes  # raw encoded file bytes (JPEG/PNG/..., or the video's container), its own frame
    reply_to: str
    with_tensors: bool = False
    video: VideoPlan | None = None  # the API's plan (transport/media/video_plan_fields.py); None: `image` is an image
    # --enable-tower-lora: the adapter the tower runs with (None: the base tower, also for an adapter
    # of the language model only); `mm_hash` is then its key (transport/embedding_cache/mm_cache.adapted_mm_hash)
    lora: LoRARequest | None = None
    alone: bool = False
    audio_tokens: int = 0  # an audio clip's placeholder tokens (`image` holds the audio file); 0: not audio

    def _fields(self):
        return {"request_id": self.request_id, "mm_hash": self.mm_hash, "reply_to": self.reply_to,
                "with_tensors": self.with_tensors, "video": None if self.video is None else video_to_map(self.video),
                "lora": _lora_to_wire(self.lora), "alone": self.alone, "audio_tokens": self.audio_tokens}

    def _payload(self):
        return [self.image]

    @classmethod
    def _build(cls, f, payload):
        need(len(payload) == 1 and isinstance(payload[0], bytes), cls.TYPE, "needs one image blob")
        video = f.opt_map("video")
        return cls(f.str("request_id"), f.mm_hash("mm_hash"), payload[0], read_address(f, "reply_to"),
                   f.bool("with_tensors"), None if video is None else video_from_fields(video),
                   _lora(f, "lora"), f.bool("alone"), f.int("audio_tokens"))


@dataclass
class EncodeDone(Message):
    """Encoder -> prefill: item `mm_hash` is in the cache (ok) or failed (error).

    Carries the tensors only when encoder and prefill share no cache dir:
    embeddings [n, hidden] and the entry's named extras, each [n, ...] (frames
    after the embeddings, in the order of `extras`' names), and the item's
    metadata (`MMEntry`, transport/embedding_cache/mm_entry.py).
    """

    TYPE: ClassVar[str] = "encode_done"
    VERSION: ClassVar[int] = 2  # 2: meta and named extras
    HAS_PAYLOAD: ClassVar[bool] = True
    request_id: str
    mm_hash: str
    ok: bool
    error: str | None = None
    embeddings: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, MetaValue] = field(default_factory=dict)

    def _fields(self):
        return {"request_id": self.request_id, "mm_hash": self.mm_hash, "ok": self.ok,
                "error": self.error, "meta": meta_to_wire(self.meta), "extras": list(self.extras)}

    def _payload(self):
        if self.embeddings is None:
            if self.extras:
                raise ValueError("extras without embeddings")
            return []
        return [self.embeddings, *self.extras.values()]

    @classmethod
    def _build(cls, f, payload):
        need(all(isinstance(p, torch.Tensor) for p in payload), cls.TYPE,
             "payload must be tensors")
        names = f.list_of("extras", str)
        need(len(set(names)) == len(names) and len(names) == max(len(payload) - 1, 0), cls.TYPE,
             "extras: one distinct name per tensor after the embeddings")
        embeddings = payload[0] if payload else None
        if embeddings is not None:
            need(embeddings.ndim == 2, cls.TYPE, "embeddings must be [n, hidden]")
            need(all(x.ndim >= 1 and x.shape[0] == embeddings.shape[0] for x in payload[1:]), cls.TYPE,
                 "extras must be [n, ...], a row per embedding row")
        try:
            meta = meta_from_wire(f.map("meta").header)
        except ValueError as e:
            raise WireError(f"{cls.TYPE}.meta: {e}") from None
        return cls(f.str("request_id"), f.mm_hash("mm_hash"), f.bool("ok"), f.opt_str("error"),
                   embeddings, dict(zip(names, payload[1:])), meta)


@dataclass
class PrefillRequest(Message):
    """API -> prefill worker: a whole request; images arrive via EncodeDone or the cache."""

    TYPE: ClassVar[str] = "prefill_request"
    VERSION: ClassVar[int] = 2  # 2: spans carry a family's metadata
    request_id: str
    prompt_token_ids: list[int]
    mm_spans: list[MMSpan]
    sampling: SamplingParams  # n == 1: the API fans n > 1 out into requests
    eos_token_ids: list[int]
    decode_worker: str | None  # None: this worker decodes too (e-pd / aggregated)
    api_index: int = 0  # which API process's collector (WorkerSpec.apis) takes its TokenOutputs
    lora: LoRARequest | None = None  # the adapter it runs with (None: the base model)

    def _fields(self):
        return {"request_id": self.request_id, "prompt_token_ids": list(self.prompt_token_ids),
                "mm_spans": [s.to_list() for s in self.mm_spans], "sampling": sampling_to_map(self.sampling),
                "eos_token_ids": list(self.eos_token_ids), "decode_worker": self.decode_worker,
                "api_index": self.api_index, "lora": _lora_to_wire(self.lora)}

    @classmethod
    def _build(cls, f, payload):
        prompt = f.token_ids("prompt_token_ids")
        return cls(f.str("request_id"), prompt, _spans(f, "mm_spans", len(prompt)),
                   sampling_from_map(f.map("sampling")), f.token_ids("eos_token_ids"),
                   read_address(f, "decode_worker", optional=True), read_api_index(f),
                   _lora(f, "lora"))


@dataclass
class KVTransfer(Message):
    """Prefill -> decode: a prefilled request and its KV blocks.

    Two frames for all KV-holding layers at once (one gather + one copy on the sender):
    k_blocks and v_blocks, each [num_layers, num_blocks, block_size,
    num_kv_heads, head_dim], blocks in token order, covering every prompt token.
    With an EAGLE-3 head (speculative decoding), three more: `draft_state`, the
    head's k and v blocks ([head_layers, num_blocks, block_size, head_kv_heads,
    head_dim], the same blocks) and its fused features of the last prompt
    position ([hidden]), so the decode worker drafts at once (engine/spec/eagle3_proposer.py).
    With a model whose layers carry per-request state (engine/state_cache.py), its named
    per-request state tensors after those (`state`: names in the header, one frame each, in
    that order): the state after the prompt, which the decode step goes on from.
    """

    TYPE: ClassVar[str] = "kv_transfer"
    VERSION: ClassVar[int] = 3  # 2: spans carry a family's metadata; 3: named per-request state
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
    lora: LoRARequest | None = None  # the PrefillRequest's adapter: decode goes on with it
    draft_state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # EAGLE-3: head k, v, features
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # named per-request state ({}: KV only)

    @property
    def num_layers(self) -> int:
        return self.k_blocks.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.k_blocks.shape[1]

    @property
    def num_bytes(self) -> int:
        """The tensors' bytes on the wire (the KV, an EAGLE-3 head's state, the per-request state)."""
        return sum(t.nbytes for t in self._payload())

    def _fields(self):
        return {"request_id": self.request_id, "prompt_token_ids": list(self.prompt_token_ids),
                "first_token_id": self.first_token_id, "sampling": sampling_to_map(self.sampling),
                "eos_token_ids": list(self.eos_token_ids),
                "mm_spans": [s.to_list() for s in self.mm_spans], "reply_to": self.reply_to,
                "api_index": self.api_index, "lora": _lora_to_wire(self.lora), "state": list(self.state)}

    def _payload(self):
        return [self.k_blocks, self.v_blocks, *(self.draft_state or ()), *self.state.values()]

    @classmethod
    def _build(cls, f, payload):
        names = f.list_of("state", str)
        need(len(set(names)) == len(names) and all(names), cls.TYPE, "state: distinct non-empty names")
        num_kv = len(payload) - len(names)
        need(num_kv in (2, 5) and all(isinstance(p, torch.Tensor) for p in payload),
             cls.TYPE, "needs k and v tensor frames (and an EAGLE-3 head's k, v and features), "
             "then one per name of `state`")
        k, v = payload[:2]
        state = dict(zip(names, payload[num_kv:]))
        draft_state = tuple(payload[2:num_kv]) or None
        if draft_state is not None:
            hk, hv, features = draft_state
            need(hk.ndim == 5 and hk.shape == hv.shape and hk.shape[1] == k.shape[1] and features.ndim == 1,
                 cls.TYPE, "the head's k/v must be equal [layers, blocks, block_size, kv_heads, head_dim] "
                 "over the KV's blocks, its features [hidden]")
        need(k.ndim == 5 and k.shape == v.shape and k.dtype == v.dtype, cls.TYPE,
             "k/v must be equal [layers, blocks, block_size, kv_heads, head_dim]")
        prompt = f.token_ids("prompt_token_ids")
        need(k.shape[1] * k.shape[2] >= len(prompt), cls.TYPE, "KV blocks shorter than prompt")
        first_token_id = f.int("first_token_id")
        need(first_token_id >= 0, cls.TYPE, "first_token_id must be a token id >= 0")
        return cls(f.str("request_id"), prompt, first_token_id, sampling_from_map(f.map("sampling")),
                   f.token_ids("eos_token_ids"), _spans(f, "mm_spans", len(prompt)), k, v,
                   read_address(f, "reply_to", optional=True) or "", read_api_index(f),
                   _lora(f, "lora"), draft_state, state)


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
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 1..n-1, with token 0 when asked

    def _fields(self):
        return {"request_id": self.request_id, "token_ids": list(self.token_ids),
                "finished": self.finished, "finish_reason": self.finish_reason,
                "num_prompt_tokens": self.num_prompt_tokens,
                "num_cached_tokens": self.num_cached_tokens, "logprobs": logprobs_to_list(self.logprobs),
                "error": self.error, "index": self.index, "is_internal_error": self.is_internal_error,
                "prompt_logprobs": logprobs_to_list(self.prompt_logprobs)}

    @classmethod
    def _build(cls, f, payload):
        token_ids, logprobs = f.token_ids("token_ids"), f.opt_list("logprobs")
        if logprobs is not None:
            need(len(logprobs) == len(token_ids), cls.TYPE, "logprobs: one entry per token")
            logprobs = logprobs_from_list(logprobs, f"{cls.TYPE}.logprobs")
        prompt_logprobs = f.opt_list("prompt_logprobs")
        if prompt_logprobs is not None:
            prompt_logprobs = logprobs_from_list(prompt_logprobs, f"{cls.TYPE}.prompt_logprobs")
        return cls(f.str("request_id"), token_ids, f.bool("finished"),
                   f.one_of("finish_reason", FINISH_REASONS), f.int("num_prompt_tokens"),
                   f.int("num_cached_tokens"), logprobs, f.opt_str("error"), f.int("index"),
                   f.bool("is_internal_error"), prompt_logprobs)


# TokenOutput's fields in the order of its list form (TokenOutputs' entries).
_TOKEN_OUTPUT_KEYS = ("request_id", "token_ids", "finished", "finish_reason", "num_prompt_tokens",
                      "num_cached_tokens", "logprobs", "error", "index", "is_internal_error", "prompt_logprobs")


@dataclass
class TokenOutputs(Message):
    """Worker -> API, once per engine step: every TokenOutput of the step bound
    for one API process, in the order the step made them.

    Each entry is a TokenOutput as an 11-item list, its fields in the order of
    `_TOKEN_OUTPUT_KEYS`, checked as TokenOutput's own fields are. A step of
    128 streams is one message (one receive, one header decode on the API's
    event loop) instead of 128. A worker still sends a lone TokenOutput for an
    output outside a step (a request that failed on admission)."""

    TYPE: ClassVar[str] = "token_outputs"
    outputs: list[TokenOutput]

    def _fields(self):
        return {"outputs": [[o.request_id, list(o.token_ids), o.finished, o.finish_reason, o.num_prompt_tokens,
                             o.num_cached_tokens, logprobs_to_list(o.logprobs), o.error, o.index,
                             o.is_internal_error, logprobs_to_list(o.prompt_logprobs)] for o in self.outputs]}

    @classmethod
    def _build(cls, f, payload):
        entries = f.list_of("outputs", list)
        outputs = []
        for i, entry in enumerate(entries):
            need(len(entry) == len(_TOKEN_OUTPUT_KEYS), cls.TYPE,
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
        is_internal_error, prompt_logprobs = entry
    if (logprobs is None and prompt_logprobs is None and type(request_id) is str and type(token_ids) is list
            and all(type(t) is int and t >= 0 for t in token_ids) and type(finished) is bool
            and (finish_reason is None or type(finish_reason) is str and finish_reason in FINISH_REASONS)
            and type(num_prompt_tokens) is int and type(num_cached_tokens) is int
            and (error is None or type(error) is str) and type(index) is int and type(is_internal_error) is bool):
        return TokenOutput(request_id, token_ids, finished, finish_reason, num_prompt_tokens, num_cached_tokens,
                           None, error, index, is_internal_error)
    return None
