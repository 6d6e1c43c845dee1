"""Prometheus text for what the workers report, labelled by role and worker.

Each worker publishes `WorkerStats` (gauges plus monotonically growing
counters); the API process renders the latest of each, so a scrape of
`/metrics` shows every worker. Names follow vLLM's under the `epd:` prefix.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from epd.serve.registry import WorkerRegistry

# worker counter key -> (metric name without _total, help)
COUNTERS = {
    "encoder_images": ("epd:encoder_images", "Images encoded by the vision tower."),
    "kv_transfer_bytes": ("epd:kv_transfer_bytes", "KV cache bytes moved from prefill to decode workers."),
    "num_preemptions": ("epd:num_preemptions", "Requests preempted for lack of KV blocks."),
    "prefix_cache_queries": ("epd:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("epd:prefix_cache_hits", "Prompt tokens found in the prefix cache."),
}
# (sum key, count key) -> (metric name, help)
SUMMARIES = {
    ("encode_seconds_sum", "encoder_images"): ("epd:encode_seconds", "Vision tower time per image batch."),
    ("encoder_queue_seconds_sum", "encoder_images"): ("epd:encoder_queue_time_seconds",
                                                       "Time images waited in an encoder's queue."),
    ("kv_transfer_seconds_sum", "kv_transfer_count"): ("epd:kv_transfer_seconds",
                                                        "Prefill-to-decode KV transfer time, send to ack."),
}


class WorkerMetrics:
    """A prometheus collector over the registry's latest stats, plus API-side counters."""

    def __init__(self, registry: WorkerRegistry):
        self.registry = registry
        self.mm_cache_queries = 0
        self.mm_cache_hits = 0
        self._prom = CollectorRegistry(auto_describe=False)
        self._prom.register(self)

    def render(self) -> bytes:
        return generate_latest(self._prom)

    def collect(self):
        labels = ["role", "worker"]
        running = GaugeMetricFamily("epd:num_requests_running", "Requests running on a worker.", labels=labels)
        waiting = GaugeMetricFamily("epd:num_requests_waiting", "Requests waiting on a worker.", labels=labels)
        usage = GaugeMetricFamily("epd:kv_cache_usage_perc", "KV cache usage (1 = full).", labels=labels)
        counters = {key: CounterMetricFamily(name, doc, labels=labels) for key, (name, doc) in COUNTERS.items()}
        summaries = {keys: SummaryMetricFamily(name, doc, labels=labels) for keys, (name, doc) in SUMMARIES.items()}
        for w in self.registry.workers.values():
            if w.stats is None:
                continue
            lv = [w.role, w.worker_id]
            s = w.stats
            running.add_metric(lv, s.num_running)
            waiting.add_metric(lv, s.num_waiting)
            if s.num_total_blocks:
                usage.add_metric(lv, s.counters.get("kv_cache_usage", 0.0))
            for key, family in counters.items():
                if key in s.counters:
                    family.add_metric(lv, s.counters[key])
            for (sum_key, count_key), family in summaries.items():
                if sum_key in s.counters:
                    family.add_metric(lv, count_value=s.counters.get(count_key, 0.0), sum_value=s.counters[sum_key])
        yield running
        yield waiting
        yield usage
        yield from counters.values()
        yield from summaries.values()
        queries = CounterMetricFamily("epd:mm_cache_queries", "Images looked up in the embedding cache.")
        queries.add_metric([], self.mm_cache_queries)
        hits = CounterMetricFamily("epd:mm_cache_hits", "Images found in the embedding cache.")
        hits.add_metric([], self.mm_cache_hits)
        yield queries
        yield hits
