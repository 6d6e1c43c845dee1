"""bench/dev/router_compare.py's pure parts: which routers it runs, each worker's load read
from Prometheus text, and a row of its table (the servers' runs are docs/benchmarks.md's)."""
from __future__ import annotations

import pytest

from bench.dev.router_compare import chosen, format_table, row, worker_values
from epd.serve.router import ROUTERS

METRICS = """# HELP epd:prefix_cache_queries_total Prompt tokens looked up in the prefix cache.
epd:prefix_cache_queries_total{role="prefill",worker="prefill-0"} 300.0
epd:prefix_cache_queries_total{role="prefill",worker="prefill-1"} 100.0
epd:prefix_cache_queries_total{role="decode",worker="decode-0"} 0.0
epd:prefix_cache_queries_created{role="prefill",worker="prefill-0"} 1.7e9
epd:num_requests_running{role="encoder",worker="encoder-0"} 2.0
epd:num_requests_running{role="decode",worker="decode-0"} 3.0
"""


def test_every_router_epd_has_now_unless_some_are_named():
    assert chosen(None, ROUTERS, "--routers") == list(ROUTERS)
    assert chosen("round_robin,", ROUTERS, "--routers") == ["round_robin"]
    with pytest.raises(ValueError, match="--routers: \\['nope'\\] not among"):
        chosen("round_robin,nope", ROUTERS, "--routers")


def test_worker_values_are_per_engine_worker():
    assert worker_values(METRICS, "epd:prefix_cache_queries_total") == {
        "prefill/prefill-0": 300.0, "prefill/prefill-1": 100.0, "decode/decode-0": 0.0}
    assert worker_values(METRICS, "epd:num_requests_running") == {"decode/decode-0": 3.0}  # no encoder


def test_a_row_reads_the_busiest_worker_against_its_roles_mean():
    result = {"completed": 4, "failed": 0, "prefix_cache_hit_rate": 0.5, "p50_ttft_ms": 20.0, "p99_ttft_ms": 90.0,
              "request_goodput": 1.5, "request_throughput": 2.0, "ttfts": [0.09, 0.01, 0.08, 0.03],
              "turn_indices": [1, 2, 1, 2]}
    tokens = {"prefill/prefill-0": 300.0, "prefill/prefill-1": 100.0, "decode/decode-0": 0.0, "decode/decode-1": 0.0}
    r = row(result, tokens, {"prefill/prefill-0": 0.5, "decode/decode-0": 1.0, "decode/decode-1": 3.0})
    assert r["max_over_mean"] == {"prefill": 1.5, "decode": 1.5}  # decode: by its mean requests
    assert row(result, tokens, {})["max_over_mean"]["decode"] is None
    assert r["p50_ttft_later_turns_ms"] == pytest.approx(20.0)  # turns 2+: 10 and 30 ms
    table = format_table({"2p-2d round_robin": r})
    assert "| 2p-2d round_robin | 50% | 20 | 90 | 20 | 1.50 | prefill 300 / 100, decode 0 / 0 | prefill 1.50x, decode 1.50x |" in table
