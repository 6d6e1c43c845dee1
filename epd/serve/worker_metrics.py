"""Prometheus text for what the workers report, labelled by role and worker.

Each worker publishes `WorkerStats` (gauges plus monotonically growing
counters); the API process renders the latest of each, so a scrape of
`/metrics` shows every worker. Names follow vLLM's under the `epd:` prefix.

The API's own counts (cache lookups and hit tokens, images per request,
failed, recovered, refused requests) are
prometheus_client Counters: with several API processes they live in the
shared metric files and are summed with the request metrics (epd/api/metrics.py),
while every process holds the same view of the workers and renders it alone.
"""
from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, SummaryMetricFamily
from prometheus_client.utils import floatToGoString

from epd.multiprocess_metrics import is_multiprocess
from epd.serve.registry import WorkerRegistry
from epd.transport.wire.histogram import IMAGE_COUNT_BOUNDS, Buckets
from epd.transport.wire.wire_values import MODALITIES, CacheFaults, EncoderCounters, EngineCounters

# Every counter a worker sends is exported (tests/unit/serve/test_worker_metrics.py checks that none is left out).
# Counters: (metric name without _total, help, the value). Summaries: (name, help, (count, sum)).
ENGINE_COUNTERS: list[tuple[str, str, Callable[[EngineCounters], int]]] = [
    ("epd:num_preemptions", "Requests preempted for lack of KV blocks.", lambda c: c.num_preemptions),
    ("epd:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", lambda c: c.prefix_cache_queries),
    ("epd:prefix_cache_hits", "Prompt tokens found in the prefix cache.", lambda c: c.prefix_cache_hits),
    ("epd:kv_transfer_bytes", "KV cache bytes moved from prefill to decode workers.", lambda c: c.kv_transfer_bytes),
    ("epd:requests_aborted", "Requests an Abort took out of a worker (client gone, stop string, retried elsewhere).",
     lambda c: c.num_aborted),
    # speculative decoding, vLLM's vllm:spec_decode_* (the per-position counts: _SpecDecodePositions)
    ("epd:spec_decode_num_drafts", "Drafts verified: one per sequence and step that verified draft tokens.",
     lambda c: c.spec_decode_num_drafts),
    ("epd:spec_decode_num_draft_tokens", "Draft tokens verified.", lambda c: c.spec_decode_num_draft_tokens),
    ("epd:spec_decode_num_accepted_tokens", "Draft tokens accepted.", lambda c: c.spec_decode_num_accepted_tokens),
    # a model with per-request state: its prefix hits resume from snapshots of it (engine/state_snapshots.py)
    ("epd:state_snapshots_saved", "Per-request state snapshots written at block boundaries.",
     lambda c: c.state_snapshots_saved),
    ("epd:state_snapshot_hits", "Prefix-cache hits that resumed from a per-request state snapshot.",
     lambda c: c.state_snapshot_hits),
]
ENGINE_SUMMARIES: list[tuple[str, str, Callable[[EngineCounters], tuple[int, float]]]] = [
    ("epd:kv_transfer_seconds", "Prefill-to-decode KV transfer time, send to ack.",
     lambda c: (c.num_kv_transfers, c.kv_transfer_seconds_sum)),
]
ENCODER_COUNTERS: list[tuple[str, str, Callable[[EncoderCounters], int]]] = [
    ("epd:encoder_images", "Images encoded by the vision tower.", lambda c: c.num_images),
    ("epd:encoder_errors", "Images an encoder refused or failed to encode.", lambda c: c.num_errors),
    ("epd:encoder_cache_skips", "Queued images already in the cache when their turn came (not encoded again).",
     lambda c: c.num_cache_skips),
    ("epd:encoder_images_aborted", "Queued images dropped because their request was aborted.",
     lambda c: c.num_aborted),
    ("epd:encoder_inline_images", "Embeddings sent inside EncodeDone (to a prefill worker on another node).",
     lambda c: c.num_inline),
    ("epd:encoder_inline_bytes", "Embedding bytes sent inside EncodeDone (deepstack included).",
     lambda c: c.inline_bytes),
    ("epd:encoder_requests_received", "EncodeRequests an encoder took from its inbox.",
     lambda c: c.num_requests_received),
    ("epd:encoder_cache_hit_tokens", "Placeholder tokens of queued images an encoder found in its cache.",
     lambda c: c.cache_hit_tokens),
    ("epd:mm_cache_evictions", "Embedding-cache entries evicted by this worker's writes.", lambda c: c.cache_evictions),
]
ENCODER_SUMMARIES: list[tuple[str, str, Callable[[EncoderCounters], tuple[int, float]]]] = [
    ("epd:encode_seconds", "Vision tower time per image (a batch's time over its images).",
     lambda c: (c.num_images, c.encode_seconds_sum)),
]
# Histograms: (name, help, the worker's bucket counts); transfer seconds are labelled by destination.
ENCODER_HISTOGRAMS: list[tuple[str, str, Callable[[EncoderCounters], Buckets]]] = [
    ("epd:encoder_queue_time_seconds", "Time images waited in an encoder's queue.", lambda c: c.queue_wait),
    ("epd:encoder_preprocess_seconds", "Decode and preprocessing time of one encoder batch.",
     lambda c: c.preprocess_seconds),
    ("epd:encoder_forward_seconds", "Vision transformer forward time of one encoder batch.",
     lambda c: c.forward_seconds),
    ("epd:encoder_batch_images", "Images in one encoder batch.", lambda c: c.batch_images),
]
ENCODER_GAUGES: list[tuple[str, str, Callable[[EncoderCounters], float]]] = [
    ("epd:encoder_queued_patches", "Vision patches of the images queued in an encoder.",
     lambda c: c.num_queued_patches),
    ("epd:mm_cache_entries", "Entries in the embedding cache this worker writes (one cache per directory).",
     lambda c: c.cache_entries),
    ("epd:mm_cache_bytes", "Bytes of the entries in the embedding cache this worker writes.", lambda c: c.cache_bytes),
    ("epd:encoder_oldest_queued_seconds", "How long the oldest image in an encoder's queue has waited (0: none).",
     lambda c: c.oldest_queued_s),
]
# Every worker with an embedding cache (any role): how its cache has fared.
CACHE_COUNTERS: list[tuple[str, str, Callable[[CacheFaults], int]]] = [
    ("epd:mm_cache_set_aside", "Unreadable embedding-cache files a worker renamed away to open a fresh cache.",
     lambda c: c.set_aside),
    ("epd:mm_cache_read_errors", "Embedding-cache reads that failed (a damaged file): each a miss.",
     lambda c: c.read_errors),
    ("epd:mm_cache_bad_entries", "Corrupt or foreign embedding-cache entries found (each a miss, deleted).",
     lambda c: c.bad_entries),
    ("epd:mm_cache_space_failures", "Embedding-cache writes skipped because the filesystem had no room.",
     lambda c: c.space_failures),
    ("epd:mm_cache_skipped_puts", "Embeddings not cached: no room, larger than the cache, or a write error.",
     lambda c: c.skipped_puts),
]
CACHE_GAUGES: list[tuple[str, str, Callable[[CacheFaults], float]]] = [
    ("epd:mm_cache_serving", "1 while a worker's embedding cache is open, 0 while it serves without one.",
     lambda c: c.serving),
]
# epd:encoder_requests_total{outcome}: how each EncodeRequest an encoder took up ended
ENCODER_OUTCOMES: list[tuple[str, Callable[[EncoderCounters], int]]] = [
    ("encoded", lambda c: c.num_images), ("cache_hit", lambda c: c.num_cache_skips),
    ("error", lambda c: c.num_errors), ("aborted", lambda c: c.num_aborted),
]
LABELS = ["role", "worker"]


class _Families:
    """The metric families of one counters type, filled worker by worker."""

    def __init__(self, counters, summaries, histograms=(), gauges=()):
        self.counters = [(CounterMetricFamily(name, doc, labels=LABELS), value) for name, doc, value in counters]
        self.summaries = [(SummaryMetricFamily(name, doc, labels=LABELS), value) for name, doc, value in summaries]
        self.histograms = [(HistogramMetricFamily(name, doc, labels=LABELS), value)
                           for name, doc, value in histograms]
        self.gauges = [(GaugeMetricFamily(name, doc, labels=LABELS), value) for name, doc, value in gauges]

    def add(self, labels: list[str], source) -> None:
        for family, value in self.counters:
            family.add_metric(labels, value(source))
        for family, value in self.summaries:
            count, total = value(source)
            family.add_metric(labels, count_value=count, sum_value=total)
        for family, value in self.histograms:
            _add_buckets(family, labels, value(source))
        for family, value in self.gauges:
            family.add_metric(labels, value(source))

    def __iter__(self):
        yield from (family for family, _ in self.counters + self.summaries + self.histograms + self.gauges)


class _EncoderExtras:
    """The encoder families with a label of their own: outcome, transfer destination, modality."""

    def __init__(self):
        self.items = CounterMetricFamily("epd:encoder_items", "Items encoded by the vision tower, by modality "
                                         "(a video counts one).", labels=LABELS + ["modality"])
        self.frames = CounterMetricFamily("epd:encoder_frames_decoded", "Frames decoded, by modality: one per "
                                          "image; a video's every frame up to its last sampled one.",
                                          labels=LABELS + ["modality"])
        self.decode = HistogramMetricFamily("epd:encoder_decode_seconds", "Time to decode one item's pixels "
                                            "(an image, or a video's frames), by modality.",
                                            labels=LABELS + ["modality"])
        self.outcomes = CounterMetricFamily("epd:encoder_requests", "EncodeRequests by how they ended: encoded, "
                                            "answered from the cache, failed, or aborted while queued.",
                                            labels=LABELS + ["outcome"])
        self.transfer = HistogramMetricFamily("epd:encoder_transfer_seconds", "Time to hand one image's "
                                              "embeddings on: written to the cache, or sent inline in EncodeDone.",
                                              labels=LABELS + ["to"])

    def add(self, labels: list[str], c: EncoderCounters) -> None:
        for outcome, value in ENCODER_OUTCOMES:
            self.outcomes.add_metric(labels + [outcome], value(c))
        _add_buckets(self.transfer, labels + ["cache"], c.cache_write_seconds)
        _add_buckets(self.transfer, labels + ["inline"], c.inline_send_seconds)
        for modality in MODALITIES:
            counts = c.modality(modality)
            self.items.add_metric(labels + [modality], counts.num_items)
            self.frames.add_metric(labels + [modality], counts.num_frames_decoded)
            _add_buckets(self.decode, labels + [modality], counts.decode_seconds)

    def __iter__(self):
        yield from (self.outcomes, self.transfer, self.items, self.frames, self.decode)


class _SpecDecodePositions:
    """vLLM's vllm:spec_decode_num_accepted_tokens_per_pos: accepted draft tokens by
    their position in the draft (0: the first), labelled `position`."""

    def __init__(self):
        self.family = CounterMetricFamily("epd:spec_decode_num_accepted_tokens_per_pos",
                                          "Draft tokens accepted, by their position in the draft.",
                                          labels=LABELS + ["position"])

    def add(self, labels: list[str], c: EngineCounters) -> None:
        for position, count in enumerate(c.spec_decode_num_accepted_tokens_per_pos):
            self.family.add_metric(labels + [str(position)], count)

    def __iter__(self):
        yield self.family


def _add_buckets(family: HistogramMetricFamily, labels: list[str], buckets: Buckets) -> None:
    family.add_metric(labels, buckets=[(floatToGoString(bound), n) for bound, n in buckets.cumulative()],
                      sum_value=buckets.sum)


class WorkerMetrics:
    """A prometheus collector over the registry's latest stats, plus API-side counters."""

    def __init__(self, registry: WorkerRegistry, worker_restarts: Callable[[], dict[str, int] | None] = dict):
        """`worker_restarts`: role -> restarts, from the supervisor (`restart_counts`); a None
        from it: another process exports them (the launcher of `--api-servers N`, in the
        shared metric files), so this one does not."""
        self.registry = registry
        self.worker_restarts = worker_restarts
        self.prefix_index = None  # --router cache_aware: its PrefixIndex (the blocks it knows each worker holds)
        self._api = CollectorRegistry()
        self.mm_cache_queries = Count(Counter("epd:mm_cache_queries", "Images looked up in the embedding cache.",
                                              registry=self._api))
        self.mm_cache_hits = Count(Counter("epd:mm_cache_hits", "Images found in the embedding cache.",
                                           registry=self._api))
        self.mm_cache_hit_tokens = Count(Counter(  # placeholder tokens of the images the API found in the cache
            "epd:mm_cache_hit_tokens", "Placeholder tokens of the images found in the embedding cache by the API "
            "(no encoder work).", registry=self._api))
        self.request_images = Histogram("epd:request_images", "Images in one request (of those with any).",
                                        buckets=IMAGE_COUNT_BOUNDS, registry=self._api)
        self.requests_failed = CountBy(Counter(  # reason -> requests that got an error we caused
            "epd:requests_failed", "Requests answered with an error the server caused (timeout, no live worker, "
            "worker errors) or bad input found by a worker.", ["reason"], registry=self._api))
        self.requests_recovered = CountBy(Counter(  # "retried" (nothing streamed yet) | "resumed"
            "epd:requests_recovered", "Requests sent again after a worker died under them: retried before any "
            "token, or resumed mid-stream.", ["how"], registry=self._api))
        self.local_prefills = Count(Counter(  # tries of short text-only prompts sent to a decode worker
            "epd:local_prefills", "Prompts prefilled on a decode worker instead of a prefill worker "
            "(text-only, at most --max-local-prefill-tokens; every try counts).", registry=self._api))
        self.local_prefills_redirected = Count(Counter(  # short text-only tries sent to an idle prefill worker
            "epd:local_prefills_redirected", "Short text-only prompts sent to an idle prefill worker because no "
            "decode worker had room for them in its next step (every try counts).", registry=self._api))
        self.requests_refused = CountBy(Counter(  # reason -> requests refused by admission control
            "epd:requests_refused", "Requests refused by admission control (503 + Retry-After).", ["reason"],
            registry=self._api))
        self._prom = CollectorRegistry(auto_describe=False)
        self._prom.register(self)

    def render(self) -> bytes:
        """The workers' metrics and the API's counts (with several API processes,
        only the workers': the request metrics' `render` sums the counts of all)."""
        text = generate_latest(self._prom)
        return text if is_multiprocess() else text + generate_latest(self._api)

    def register(self, collector) -> None:
        """Another collector rendered with these metrics (the encoder pool's)."""
        self._prom.register(collector)

    def collect(self):
        running = GaugeMetricFamily("epd:num_requests_running", "Requests running on a worker.", labels=LABELS)
        waiting = GaugeMetricFamily("epd:num_requests_waiting", "Requests waiting on a worker.", labels=LABELS)
        usage = GaugeMetricFamily("epd:kv_cache_usage_perc", "KV cache usage (1 = full).", labels=LABELS)
        state_usage = GaugeMetricFamily("epd:state_cache_usage_perc", "Per-request state cache usage (1 = every "
                                        "slot held by a running request).", labels=LABELS)
        engine = _Families(ENGINE_COUNTERS, ENGINE_SUMMARIES)
        positions = _SpecDecodePositions()
        encoder = _Families(ENCODER_COUNTERS, ENCODER_SUMMARIES, ENCODER_HISTOGRAMS, ENCODER_GAUGES)
        encoder_extras = _EncoderExtras()
        cache = _Families(CACHE_COUNTERS, (), gauges=CACHE_GAUGES)
        lora = GaugeMetricFamily(*LORA_INFO, labels=[*LABELS, *LORA_INFO_LABELS])
        lora_cpu = GaugeMetricFamily(*LORA_CPU, labels=LABELS)
        index_blocks = GaugeMetricFamily(*ROUTER_CACHED_BLOCKS, labels=LABELS)
        for w in self.registry.workers.values():
            s = w.stats
            if s is None or not self.registry.reports(w):  # a dead worker's last numbers describe nothing
                continue
            labels = [w.role, metrics_worker_name(w.worker_id)]
            running.add_metric(labels, s.num_running)
            waiting.add_metric(labels, s.num_waiting)
            if s.num_total_blocks:
                usage.add_metric(labels, 1.0 - s.num_free_blocks / s.num_total_blocks)
            if s.num_state_slots:  # a model with per-request state (engine/state_cache.py)
                state_usage.add_metric(labels, 1.0 - s.num_free_state_slots / s.num_state_slots)
            if s.engine is not None:
                engine.add(labels, s.engine)
                positions.add(labels, s.engine)
            if s.encoder is not None:  # encoders, and the aggregated worker's in-process encoder
                encoder.add(labels, s.encoder)
                encoder_extras.add(labels, s.encoder)
            if s.cache is not None:
                cache.add(labels, s.cache)
            if self.prefix_index is not None and s.engine is not None:
                index_blocks.add_metric(labels, self.prefix_index.num_blocks(w.worker_id))
            if s.lora is not None and s.engine is not None:  # encoders report tower adapters for the router only
                lora.add_metric([*labels, ",".join(s.lora.running), ",".join(s.lora.waiting), str(s.lora.max_lora)],
                                time.time() - (time.monotonic() - w.last_seen_s))
                lora_cpu.add_metric(labels, s.lora.num_cpu_loras)
        yield running
        yield waiting
        yield usage
        yield state_usage
        yield from engine
        yield from positions
        yield from encoder
        yield from encoder_extras
        yield from cache
        yield lora
        yield lora_cpu
        if self.prefix_index is not None:
            yield index_blocks
        restarts = self.worker_restarts()
        if restarts is not None:
            yield _labelled(WORKER_RESTARTS[0], WORKER_RESTARTS[1], "role", restarts)


# vLLM's `lora_requests_info`: one sample per engine worker with --enable-lora, the names of the
# adapters its running and waiting requests use (comma-joined) and --max-loras as labels, the
# time of the report (seconds since the epoch) as the value, as vLLM sets it
LORA_INFO = ("epd:lora_requests_info", "Running stats on LoRA requests (adapters in labels).")
LORA_INFO_LABELS = ("running_lora_adapters", "waiting_lora_adapters", "max_lora")
LORA_CPU = ("epd:lora_cpu_adapters", "LoRA adapters an engine worker holds in host memory (at most "
            "--max-cpu-loras, beside those its running requests still use).")
WORKER_RESTARTS = ("epd:worker_restarts", "Worker processes restarted after they exited.")
ROUTER_CACHED_BLOCKS = ("epd:router_cached_blocks", "KV blocks the cache-aware router knows an engine worker holds "
                        "(from its prefix cache's changes; not the blocks just routed there).")


def metrics_worker_name(worker_id: str) -> str:
    """The `worker` label: the worker id, but for an `epd worker` ("encoder@HOST:PORT")
    its role and a short digest of the rest: /metrics, often scraped from outside,
    names no host or port (the API's log has the whole id)."""
    role, at, where = worker_id.partition("@")
    return worker_id if not at else f"{role}@{hashlib.sha256(where.encode()).hexdigest()[:8]}"


def _labelled(name: str, doc: str, label: str, values: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([str(key)], value)
    return family


class Count:
    """A prometheus Counter that reads like an int counter: `count += n`."""

    def __init__(self, counter):
        self.counter = counter

    def __iadd__(self, amount: int) -> Count:
        self.counter.inc(amount)
        return self


class CountBy:
    """A labelled prometheus Counter that reads like a `collections.Counter`: `counts[label] += n`."""

    def __init__(self, counter):
        self.counter = counter

    def __getitem__(self, label: str) -> Count:
        return Count(self.counter.labels(label))

    def __setitem__(self, label: str, count: Count) -> None:
        pass  # `counts[label] += n` incremented the child in Count.__iadd__ already
