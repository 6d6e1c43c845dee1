"""/metrics for what workers report: every counter a worker sends is exported, under its labels."""
from __future__ import annotations

from dataclasses import astuple, fields

from prometheus_client.parser import text_string_to_metric_families

from epd.serve.registry import WorkerRegistry
from epd.serve.worker_metrics import WorkerMetrics
from epd.transport.messages import Ready, WorkerStats
from epd.transport.wire_values import EncoderCounters, EngineCounters

# distinct values, so each exported sample names the one counter it came from
ENGINE = EngineCounters(num_preemptions=2, prefix_cache_queries=3, prefix_cache_hits=5, kv_transfer_bytes=7,
                        num_kv_transfers=11, kv_transfer_seconds_sum=13.5)
ENCODER = EncoderCounters(num_images=17, num_errors=19, num_cache_skips=23, encode_seconds_sum=29.5,
                          num_queued=31, queue_seconds_sum=37.5, num_aborted=41, oldest_queued_s=43.5,
                          num_inline=47, inline_bytes=53)


def _render(*stats: WorkerStats) -> dict[tuple[str, str], dict[str, float]]:
    """worker id -> {sample name: value} of the worker-labelled samples."""
    registry = WorkerRegistry()
    for s in stats:
        registry.on_ready(Ready(s.worker_id, s.role, f"ipc:///tmp/x/{s.worker_id}.sock", "h"))
        registry.on_stats(s)
    out: dict = {}
    for family in text_string_to_metric_families(WorkerMetrics(registry).render().decode()):
        for sample in family.samples:
            if "worker" in sample.labels:
                out.setdefault(sample.labels["worker"], {})[sample.name] = sample.value
    return out


def test_every_counter_is_exported_with_its_worker_labels():
    samples = _render(WorkerStats("decode-0", "decode", 3, 1, 24, 32, 0, engine=ENGINE),
                      WorkerStats("encoder-0", "encoder", 0, 2, 0, 0, 2, encoder=ENCODER),
                      WorkerStats("aggregated-0", "aggregated", 1, 0, 8, 8, 0, engine=ENGINE, encoder=ENCODER))
    decode, encoder, aggregated = samples["decode-0"], samples["encoder-0"], samples["aggregated-0"]
    assert [f.name for f, v in zip(fields(ENGINE), astuple(ENGINE)) if v not in decode.values()] == []
    assert [f.name for f, v in zip(fields(ENCODER), astuple(ENCODER)) if v not in encoder.values()] == []
    assert set(astuple(ENGINE)) | set(astuple(ENCODER)) <= set(aggregated.values())
    assert decode["epd:num_preemptions_total"] == 2
    assert decode["epd:prefix_cache_queries_total"] == 3 and decode["epd:prefix_cache_hits_total"] == 5
    assert decode["epd:kv_transfer_bytes_total"] == 7
    assert (decode["epd:kv_transfer_seconds_count"], decode["epd:kv_transfer_seconds_sum"]) == (11, 13.5)
    assert encoder["epd:encoder_images_total"] == 17 and encoder["epd:encoder_errors_total"] == 19
    assert encoder["epd:encoder_cache_skips_total"] == 23
    assert (encoder["epd:encode_seconds_count"], encoder["epd:encode_seconds_sum"]) == (17, 29.5)
    assert (encoder["epd:encoder_queue_time_seconds_count"],
            encoder["epd:encoder_queue_time_seconds_sum"]) == (31, 37.5)
    assert encoder["epd:encoder_oldest_queued_seconds"] == 43.5


def test_a_worker_shows_only_what_its_role_counts():
    samples = _render(WorkerStats("decode-0", "decode", 3, 1, 24, 32, 0, engine=ENGINE),
                      WorkerStats("encoder-0", "encoder", 0, 2, 0, 0, 2, encoder=ENCODER))
    assert not any(name.startswith("epd:encode") for name in samples["decode-0"])
    assert "epd:kv_transfer_bytes_total" not in samples["encoder-0"]
    assert "epd:kv_cache_usage_perc" not in samples["encoder-0"]  # holds no KV cache
    assert samples["decode-0"]["epd:kv_cache_usage_perc"] == 0.25  # 24 of 32 blocks free
    assert (samples["decode-0"]["epd:num_requests_running"], samples["decode-0"]["epd:num_requests_waiting"]) == (3, 1)
