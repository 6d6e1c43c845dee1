"""Request-level Prometheus metrics seen from the API process, named like vLLM's.

Exposed names (each labelled `model_name`): `epd:prompt_tokens_total`,
`epd:generation_tokens_total`, `epd:request_success_total{finished_reason}`,
`epd:time_to_first_token_seconds`, `epd:inter_token_latency_seconds`,
`epd:e2e_request_latency_seconds`, `epd:request_queue_time_seconds` (histograms
with vLLM's buckets).

`request_queue_time_seconds` is measured here, at the API: from the request's
arrival until its PrefillRequest leaves for a prefill worker (media fetch,
tokenization, routing), read from the first Delta's `dispatched_s`. vLLM's
counts time in the engine's waiting queue; ours does not see the prefill
worker's queue (its `num_requests_waiting` gauge does).
prometheus_client appends `_total` to counters, so they are declared without it.
Server-level gauges (running, waiting, KV usage) come from the workers, through
the orchestrator's `metrics_text()`.

With several API processes (`epd serve --api-servers N`) the launcher sets
PROMETHEUS_MULTIPROC_DIR: prometheus_client then keeps every process's
counters and histograms in files there, and whichever process a scrape
reaches renders their sum (`render`), so /metrics reads as one server's.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from epd.multiprocess_metrics import is_multiprocess
from epd.requests import Delta

# vLLM's bucket boundaries, so dashboards built for vLLM read ours unchanged
TTFT_BUCKETS_S = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS_S = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0]
E2E_BUCKETS_S = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                 240.0, 480.0, 960.0, 1920.0, 7680.0]


def render(registry: CollectorRegistry) -> bytes:
    """Prometheus text of `registry`; with several API processes, of all their metric files summed."""
    if not is_multiprocess():
        return generate_latest(registry)
    from prometheus_client.multiprocess import MultiProcessCollector

    combined = CollectorRegistry()
    MultiProcessCollector(combined)
    return generate_latest(combined)


class ApiMetrics:
    """A dedicated registry (never the process-global one) for one served model."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.prompt_tokens = Counter("epd:prompt_tokens", "Number of prefill tokens processed.",
                                     labels, registry=self.registry).labels(model_name)
        self.generation_tokens = Counter("epd:generation_tokens", "Number of generation tokens processed.",
                                         labels, registry=self.registry).labels(model_name)
        self.request_success = Counter("epd:request_success", "Count of successfully processed requests.",
                                       labels + ["finished_reason"], registry=self.registry)
        self.time_to_first_token = Histogram(
            "epd:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            labels, buckets=TTFT_BUCKETS_S, registry=self.registry).labels(model_name)
        self.inter_token_latency = Histogram(
            "epd:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            labels, buckets=ITL_BUCKETS_S, registry=self.registry).labels(model_name)
        self.request_queue_time = Histogram(
            "epd:request_queue_time_seconds",
            "Histogram of time from arrival at the API until the request is handed to a prefill worker.",
            labels, buckets=E2E_BUCKETS_S, registry=self.registry).labels(model_name)
        self.e2e_request_latency = Histogram(
            "epd:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            labels, buckets=E2E_BUCKETS_S, registry=self.registry).labels(model_name)

    def render(self) -> bytes:
        """Prometheus text format (0.0.4)."""
        return render(self.registry)

    def track(self, num_sequences: int, arrival_s: float | None = None) -> RequestTracker:
        return RequestTracker(self, num_sequences, time.monotonic() if arrival_s is None else arrival_s)


class RequestTracker:
    """Feeds one HTTP request's Deltas (all of its `n` sequences) into the metrics.

    Prompt tokens count once per request, as in `usage`; each sequence has its
    own first token, inter-token gaps (one per Delta, as vLLM observes one per
    engine step) and end. A sequence that never finishes (client gone) counts
    its tokens but not as a success.
    """

    def __init__(self, metrics: ApiMetrics, num_sequences: int, arrival_s: float):
        self.metrics = metrics
        self.arrival_s = arrival_s
        self._last_token_s: list[float | None] = [None] * num_sequences
        self._queued = [False] * num_sequences
        self._counted_prompt = False

    def on_delta(self, index: int, delta: Delta, now_s: float | None = None) -> None:
        m = self.metrics
        now_s = time.monotonic() if now_s is None else now_s
        if not self._counted_prompt:
            self._counted_prompt = True
            m.prompt_tokens.inc(delta.num_prompt_tokens)
        if not self._queued[index] and delta.dispatched_s is not None:
            self._queued[index] = True
            m.request_queue_time.observe(max(0.0, delta.dispatched_s - self.arrival_s))
        if delta.token_ids:
            m.generation_tokens.inc(len(delta.token_ids))
            last_s = self._last_token_s[index]
            if last_s is None:
                m.time_to_first_token.observe(now_s - self.arrival_s)
            else:
                m.inter_token_latency.observe(now_s - last_s)
            self._last_token_s[index] = now_s
        if delta.finish_reason is not None:
            m.e2e_request_latency.observe(now_s - self.arrival_s)
            m.request_success.labels(m.model_name, delta.finish_reason).inc()
