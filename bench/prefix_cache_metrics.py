"""The prefix cache's hit rate over a run of `epd bench serve`, from the server's /metrics.

EPD's workers count the prompt tokens they looked up in their prefix cache and
those they found (`epd:prefix_cache_queries_total`, `epd:prefix_cache_hits_total`,
one label set per worker); vLLM counts the same under `vllm:` (one per engine).
Each is summed over its label sets, read before and after the measured run; the
run's hit rate is hits / queries of the difference. A server with neither gives
no fields.
"""
from __future__ import annotations

NAMES = {"epd": ("epd:prefix_cache_queries_total", "epd:prefix_cache_hits_total"),
         "vllm": ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")}


def sum_counter(text: str, metric: str) -> float | None:
    """`metric` summed over its label sets in Prometheus text; None when it is not there."""
    total = None
    for line in text.splitlines():
        if line.startswith(metric) and line[len(metric):len(metric) + 1] in ("{", " "):
            total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
    return total


def parse_prefix_counters(text: str) -> dict[str, float] | None:
    """{'queries': tokens looked up, 'hits': tokens found}: EPD's names, else vLLM's; None: neither."""
    for queries_name, hits_name in NAMES.values():
        queries = sum_counter(text, queries_name)
        if queries is not None:
            return {"queries": queries, "hits": sum_counter(text, hits_name) or 0.0}
    return None


def hit_rate_fields(before: dict[str, float] | None, after: dict[str, float] | None) -> dict:
    """The run's `prefix_cache_*` fields for the result JSON ({} without counters);
    the hit rate is None when no prompt token was looked up (prefix caching off)."""
    if before is None or after is None:
        return {}
    queries, hits = (int(after[name] - before[name]) for name in ("queries", "hits"))
    return {"prefix_cache_queries": queries, "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries if queries else None}
