"""The values messages carry, with their msgpack forms: sampling parameters,
token logprobs and the worker counters.

SamplingParams and TokenLogprobs are defined in sampling.py, torch-free, since
the scheduler and the API build and read them away from the wire; their forms
are here because reading a form needs codec.Fields (which imports torch).
Each form is written out field by field, and reading one checks it as strictly
as a message header: a missing, unknown or mistyped key is a WireError, and so
is a SamplingParams that `validate` refuses.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from epd.transport.wire.codec import Fields, WireError
from epd.transport.wire.histogram import ENCODER_SECONDS_BOUNDS, IMAGE_COUNT_BOUNDS, Buckets
from epd.transport.wire.sampling import SamplingParams, StructuredOutputsParams, TokenLogprobs

__all__ = ["MODALITIES", "CacheFaults", "EncoderCounters", "EngineCounters", "ModalityCounters",
           "logprobs_from_list", "logprobs_to_list", "sampling_from_map", "sampling_to_map"]
MODALITIES = ("image", "video", "audio")  # the `modality` label of the encoder's per-modality metrics


def sampling_to_map(p: SamplingParams) -> dict[str, Any]:
    """Every SamplingParams field by name (tests/unit/transport/test_messages.py checks none is left out)."""
    return {"n": p.n, "temperature": float(p.temperature), "top_p": float(p.top_p), "top_k": p.top_k,
            "min_p": float(p.min_p), "seed": p.seed, "presence_penalty": float(p.presence_penalty),
            "frequency_penalty": float(p.frequency_penalty), "repetition_penalty": float(p.repetition_penalty),
            "max_tokens": p.max_tokens, "min_tokens": p.min_tokens, "stop": list(p.stop),
            "stop_token_ids": list(p.stop_token_ids), "ignore_eos": p.ignore_eos, "logprobs": p.logprobs,
            "skip_special_tokens": p.skip_special_tokens,
            # msgpack map keys stay strings: token ids as [[id, bias], ...]
            "logit_bias": None if p.logit_bias is None else [[t, float(b)] for t, b in p.logit_bias.items()],
            "allowed_token_ids": None if p.allowed_token_ids is None else list(p.allowed_token_ids),
            "bad_words": list(p.bad_words),
            "structured_outputs": None if p.structured_outputs is None else p.structured_outputs.to_map(),
            "stream_interval": p.stream_interval, "include_stop_str_in_output": p.include_stop_str_in_output,
            "prompt_logprobs": p.prompt_logprobs}


def sampling_from_map(m: Fields) -> SamplingParams:
    """Every key present and typed, no other key, and values SamplingParams.validate
    accepts (the same check the API's edge runs)."""
    kwargs = dict(
        n=m.int("n"), temperature=m.float("temperature"), top_p=m.float("top_p"), top_k=m.int("top_k"),
        min_p=m.float("min_p"), seed=m.opt_int("seed"), presence_penalty=m.float("presence_penalty"),
        frequency_penalty=m.float("frequency_penalty"), repetition_penalty=m.float("repetition_penalty"),
        max_tokens=m.opt_int("max_tokens"), min_tokens=m.int("min_tokens"), stop=m.list_of("stop", str),
        stop_token_ids=m.token_ids("stop_token_ids"), ignore_eos=m.bool("ignore_eos"),
        logprobs=m.opt_int("logprobs"), skip_special_tokens=m.bool("skip_special_tokens"),
        logit_bias=m.opt_list("logit_bias"), allowed_token_ids=m.opt_list("allowed_token_ids"),
        bad_words=m.list_of("bad_words", str), structured_outputs=m.opt_map("structured_outputs"),
        stream_interval=m.int("stream_interval"), include_stop_str_in_output=m.bool("include_stop_str_in_output"),
        prompt_logprobs=m.opt_int("prompt_logprobs"))
    m.reject_unknown(kwargs)
    if kwargs["logit_bias"] is not None:
        if not all(isinstance(e, list) and len(e) == 2 and type(e[0]) is int and e[0] >= 0
                   and type(e[1]) in (int, float) for e in kwargs["logit_bias"]):
            raise WireError(f"{m.tag}.logit_bias: expected [[token_id, bias], ...]")
        kwargs["logit_bias"] = {t: float(b) for t, b in kwargs["logit_bias"]}
    if kwargs["allowed_token_ids"] is not None:
        kwargs["allowed_token_ids"] = m.token_ids("allowed_token_ids")
    so = kwargs["structured_outputs"]
    try:
        if so is not None:
            kind, spec = so.str("kind"), so.str("spec")
            so.reject_unknown(("kind", "spec"))
            kwargs["structured_outputs"] = StructuredOutputsParams.from_kind(kind, spec)
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise WireError(f"{m.tag}: {e}") from None


def logprobs_to_list(entries: list[TokenLogprobs] | None) -> list | None:
    """One [token_id, logprob, rank, [[id, logprob], ...]] per token."""
    if entries is None:
        return None
    return [[e.token_id, e.logprob, e.rank, [[i, lp] for i, lp in e.top]] for e in entries]


def logprobs_from_list(items: list, where: str) -> list[TokenLogprobs]:
    if not all(_is_logprob_entry(v) for v in items):
        raise WireError(f"{where}: entries must be [token_id, logprob, rank >= 1, [[id, logprob], ...]]")
    return [TokenLogprobs(v[0], float(v[1]), v[2], [(i, float(lp)) for i, lp in v[3]]) for v in items]


def _is_logprob_entry(v: Any) -> bool:
    return (isinstance(v, list) and len(v) == 4 and type(v[0]) is int and v[0] >= 0
            and type(v[1]) in (int, float) and type(v[2]) is int and v[2] >= 1 and isinstance(v[3], list)
            and all(isinstance(p, list) and len(p) == 2 and type(p[0]) is int and p[0] >= 0
                    and type(p[1]) in (int, float) for p in v[3]))


@dataclass
class EngineCounters:
    """Totals since an engine worker (prefill, decode, pd, aggregated) started; each
    one is exported by epd/serve/worker_metrics.py."""

    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, found
    kv_transfer_bytes: int = 0  # decode side: KV received from prefill workers
    num_kv_transfers: int = 0  # prefill side: KV sent and acked, timed in kv_transfer_seconds_sum
    kv_transfer_seconds_sum: float = 0.0  # send to ack
    num_aborted: int = 0  # requests an Abort took out of this worker (waiting, running or in transfer)
    # speculative decoding (engine/spec/decode.py): sequences that verified a draft in a step, their
    # draft tokens, those accepted, and per draft position how often its token was accepted
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # a model with per-request state (engine/state_snapshots.py): snapshots of it written at block
    # boundaries, and prefix hits that resumed from one
    state_snapshots_saved: int = 0
    state_snapshot_hits: int = 0

    def to_map(self) -> dict[str, Any]:
        return {"num_preemptions": self.num_preemptions, "prefix_cache_queries": self.prefix_cache_queries,
                "prefix_cache_hits": self.prefix_cache_hits, "kv_transfer_bytes": self.kv_transfer_bytes,
                "num_kv_transfers": self.num_kv_transfers, "kv_transfer_seconds_sum": self.kv_transfer_seconds_sum,
                "num_aborted": self.num_aborted, "spec_decode_num_drafts": self.spec_decode_num_drafts,
                "spec_decode_num_draft_tokens": self.spec_decode_num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.spec_decode_num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.spec_decode_num_accepted_tokens_per_pos),
                "state_snapshots_saved": self.state_snapshots_saved, "state_snapshot_hits": self.state_snapshot_hits}

    @staticmethod
    def from_map(m: Fields) -> EngineCounters:
        out = EngineCounters(
            num_preemptions=m.int("num_preemptions"), prefix_cache_queries=m.int("prefix_cache_queries"),
            prefix_cache_hits=m.int("prefix_cache_hits"), kv_transfer_bytes=m.int("kv_transfer_bytes"),
            num_kv_transfers=m.int("num_kv_transfers"), kv_transfer_seconds_sum=m.float("kv_transfer_seconds_sum"),
            num_aborted=m.int("num_aborted"), spec_decode_num_drafts=m.int("spec_decode_num_drafts"),
            spec_decode_num_draft_tokens=m.int("spec_decode_num_draft_tokens"),
            spec_decode_num_accepted_tokens=m.int("spec_decode_num_accepted_tokens"),
            spec_decode_num_accepted_tokens_per_pos=m.list_of("spec_decode_num_accepted_tokens_per_pos", int),
            state_snapshots_saved=m.int("state_snapshots_saved"), state_snapshot_hits=m.int("state_snapshot_hits"))
        m.reject_unknown(out.to_map())
        return out


@dataclass
class ModalityCounters:
    """An encoder's work on one modality since it started (epd:encoder_items_total{modality},
    epd:encoder_frames_decoded_total{modality}, epd:encoder_decode_seconds{modality})."""

    num_items: int = 0  # encoded by the vision tower (a video counts one)
    num_frames_decoded: int = 0  # an image: one; a video: every frame decoded, up to its last sampled one
    decode_seconds: Buckets = field(default_factory=lambda: Buckets(ENCODER_SECONDS_BOUNDS))  # per item

    def observe_decode(self, num_frames: int, seconds: float) -> None:
        self.num_frames_decoded += num_frames
        self.decode_seconds.observe(seconds)

    def to_map(self) -> dict[str, Any]:
        return {"num_items": self.num_items, "num_frames_decoded": self.num_frames_decoded,
                "decode_seconds": self.decode_seconds.to_list()}

    @staticmethod
    def from_map(m: Fields) -> ModalityCounters:
        out = ModalityCounters(m.int("num_items"), m.int("num_frames_decoded"),
                               Buckets.from_list(m.opt_list("decode_seconds"), ENCODER_SECONDS_BOUNDS,
                                                 f"{m.tag}.decode_seconds"))
        m.reject_unknown(out.to_map())
        return out


@dataclass
class EncoderCounters:
    """Totals since an encoder (or the aggregated worker's in-process encoder) started;
    each one is exported by epd/serve/worker_metrics.py."""

    num_images: int = 0  # encoded by the vision tower
    num_errors: int = 0  # refused or failed to decode: answered with EncodeDone(ok=False)
    num_cache_skips: int = 0  # queued, then found in the cache (encoded meanwhile, or before on this host)
    encode_seconds_sum: float = 0.0  # vision tower time, all batches
    num_aborted: int = 0  # queued images dropped because their request was aborted
    # routing (epd/serve/encoder_router.py): the work this encoder holds
    num_requests_received: int = 0  # EncodeRequests taken from the inbox
    num_queued_patches: int = 0  # vision patches of the images queued now (a gauge)
    # histograms (transport/wire/histogram.py), and the encoder's view of its embedding cache
    queue_wait: Buckets = field(default_factory=lambda: Buckets(ENCODER_SECONDS_BOUNDS))  # per image
    preprocess_seconds: Buckets = field(default_factory=lambda: Buckets(ENCODER_SECONDS_BOUNDS))  # per batch
    forward_seconds: Buckets = field(default_factory=lambda: Buckets(ENCODER_SECONDS_BOUNDS))  # per batch
    cache_write_seconds: Buckets = field(default_factory=lambda: Buckets(ENCODER_SECONDS_BOUNDS))  # per image
    inline_send_seconds: Buckets = field(default_factory=lambda: Buckets(ENCODER_SECONDS_BOUNDS))  # per image
    batch_images: Buckets = field(default_factory=lambda: Buckets(IMAGE_COUNT_BOUNDS))  # per batch
    cache_hit_tokens: int = 0  # placeholder tokens of the images counted in num_cache_skips
    cache_evictions: int = 0  # entries this encoder's writes evicted
    cache_entries: int = 0  # gauges: the cache this encoder writes (shared by every worker using its dir)
    cache_bytes: int = 0
    num_inline: int = 0  # embeddings sent inside EncodeDone (a prefill worker sharing no cache, or a full cache)
    inline_bytes: int = 0  # their tensor bytes, extras included
    # not a total but a gauge: how long the oldest image still queued has waited (0 when none);
    # the encoder autoscaler's signal (epd/processes/autoscale.py)
    oldest_queued_s: float = 0.0
    # per modality (MODALITIES): items encoded, frames decoded, decode seconds
    image: ModalityCounters = field(default_factory=ModalityCounters)
    video: ModalityCounters = field(default_factory=ModalityCounters)
    audio: ModalityCounters = field(default_factory=ModalityCounters)  # a clip: one item, no frames

    def modality(self, name: str) -> ModalityCounters:
        """The counters of `name`, one of MODALITIES."""
        assert name in MODALITIES, name
        return getattr(self, name)

    _HISTOGRAMS = {"queue_wait": ENCODER_SECONDS_BOUNDS, "preprocess_seconds": ENCODER_SECONDS_BOUNDS,
                   "forward_seconds": ENCODER_SECONDS_BOUNDS, "cache_write_seconds": ENCODER_SECONDS_BOUNDS,
                   "inline_send_seconds": ENCODER_SECONDS_BOUNDS, "batch_images": IMAGE_COUNT_BOUNDS}
    _INTS = ("num_images", "num_errors", "num_cache_skips", "num_aborted", "num_requests_received",
             "num_queued_patches", "cache_hit_tokens", "cache_evictions", "cache_entries", "cache_bytes",
             "num_inline", "inline_bytes")

    def to_map(self) -> dict[str, Any]:
        return {**{name: getattr(self, name) for name in self._INTS},
                "encode_seconds_sum": self.encode_seconds_sum, "oldest_queued_s": self.oldest_queued_s,
                **{name: getattr(self, name).to_list() for name in self._HISTOGRAMS},
                **{name: self.modality(name).to_map() for name in MODALITIES}}

    @staticmethod
    def from_map(m: Fields) -> EncoderCounters:
        out = EncoderCounters(**{name: m.int(name) for name in EncoderCounters._INTS},
                              encode_seconds_sum=m.float("encode_seconds_sum"),
                              oldest_queued_s=m.float("oldest_queued_s"),
                              **{name: Buckets.from_list(m.opt_list(name), bounds, f"{m.tag}.{name}")
                                 for name, bounds in EncoderCounters._HISTOGRAMS.items()},
                              **{name: ModalityCounters.from_map(m.map(name)) for name in MODALITIES})
        m.reject_unknown(out.to_map())
        return out


@dataclass
class CacheFaults:
    """How a worker's embedding cache has fared since the worker started (transport/embedding_cache/mm_cache.py):
    the faults that make a disposable cache quietly useless, exported by epd/serve/worker_metrics.py."""

    serving: int = 1  # a gauge: 1 while the cache is open, 0 while the worker serves without one
    set_aside: int = 0  # unreadable cache files this worker renamed away to open a fresh cache
    read_errors: int = 0  # reads LMDB failed: each a miss
    bad_entries: int = 0  # corrupt or foreign values found (each a miss, deleted)
    space_failures: int = 0  # writes skipped for lack of room on the filesystem (or in the map)
    skipped_puts: int = 0  # every write not cached: no room, too large, an LMDB error

    _INTS = ("serving", "set_aside", "read_errors", "bad_entries", "space_failures", "skipped_puts")

    def to_map(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._INTS}

    @staticmethod
    def from_map(m: Fields) -> CacheFaults:
        out = CacheFaults(**{name: m.int(name) for name in CacheFaults._INTS})
        m.reject_unknown(out.to_map())
        return out


@dataclass(frozen=True)
class LoRAState:
    """A worker's adapters (--enable-lora), in its stats: the names of those its
    running and waiting requests use (vLLM's `lora_requests_info` labels, exported
    by epd/serve/worker_metrics.py), those resident in its slots (the routers prefer
    a worker that has a request's adapter resident: epd/serve/router.py), and
    --max-loras; and how many adapters it holds in host memory (`num_cpu_loras`:
    at most --max-cpu-loras, beside those kept for their running requests)."""

    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    resident: tuple[str, ...] = ()
    max_lora: int = 1
    num_cpu_loras: int = 0

    def to_map(self) -> dict[str, Any]:
        return {"running": list(self.running), "waiting": list(self.waiting), "resident": list(self.resident),
                "max_lora": self.max_lora, "num_cpu_loras": self.num_cpu_loras}

    @staticmethod
    def from_map(m: Fields) -> LoRAState:
        out = LoRAState(*(tuple(m.list_of(name, str)) for name in ("running", "waiting", "resident")),
                        m.int("max_lora"), m.int("num_cpu_loras"))
        m.reject_unknown(out.to_map())
        return out
