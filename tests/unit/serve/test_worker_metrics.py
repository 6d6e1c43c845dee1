"""/metrics for what workers report: every counter a worker sends is exported, under its labels."""
from __future__ import annotations

from dataclasses import astuple, fields

from prometheus_client.parser import text_string_to_metric_families

from epd.serve.registry import WorkerRegistry
from epd.serve.worker_metrics import WorkerMetrics
from epd.transport.wire.messages import Ready, WorkerStats
from epd.transport.wire.wire_values import CacheFaults, EncoderCounters, EngineCounters

# distinct values, so each exported sample names the one counter it came from
ENGINE = EngineCounters(num_preemptions=2, prefix_cache_queries=3, prefix_cache_hits=5, kv_transfer_bytes=7,
                        num_kv_transfers=11, kv_transfer_seconds_sum=13.5, spec_decode_num_drafts=83,
                        spec_decode_num_draft_tokens=89, spec_decode_num_accepted_tokens=97,
                        spec_decode_num_accepted_tokens_per_pos=[101, 103], state_snapshots_saved=107,
                        state_snapshot_hits=109)
ENCODER = EncoderCounters(num_images=17, num_errors=19, num_cache_skips=23, encode_seconds_sum=29.5,
                          num_aborted=41, num_requests_received=43, num_queued_patches=47, cache_hit_tokens=53,
                          cache_evictions=59, cache_entries=61, cache_bytes=67,
                          num_inline=71, inline_bytes=73, oldest_queued_s=79.5)
ENCODER.queue_wait.observe(0.02, times=31)  # 31 images waited 20 ms each
ENCODER.preprocess_seconds.observe(0.3)
ENCODER.preprocess_seconds.observe(3.0, times=2)
ENCODER.forward_seconds.observe(7.0, times=5)
ENCODER.cache_write_seconds.observe(0.004, times=3)
ENCODER.inline_send_seconds.observe(0.0005, times=2)
ENCODER.batch_images.observe(3, times=5)


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
    assert [f.name for f, v in zip(fields(ENGINE), astuple(ENGINE))
            if not isinstance(v, list) and v not in decode.values()] == []  # the list: per position, below
    assert [f.name for f, v in zip(fields(ENCODER), astuple(ENCODER))
            if not isinstance(v, tuple) and v not in encoder.values()] == []
    assert {v for v in astuple(ENGINE) + astuple(ENCODER) if not isinstance(v, (tuple, list))} \
        <= set(aggregated.values())
    assert decode["epd:num_preemptions_total"] == 2
    assert decode["epd:prefix_cache_queries_total"] == 3 and decode["epd:prefix_cache_hits_total"] == 5
    assert decode["epd:kv_transfer_bytes_total"] == 7
    assert (decode["epd:kv_transfer_seconds_count"], decode["epd:kv_transfer_seconds_sum"]) == (11, 13.5)
    assert encoder["epd:encoder_images_total"] == 17 and encoder["epd:encoder_errors_total"] == 19
    assert encoder["epd:encoder_cache_skips_total"] == 23
    assert (encoder["epd:encode_seconds_count"], encoder["epd:encode_seconds_sum"]) == (17, 29.5)
    assert encoder["epd:encoder_images_aborted_total"] == 41
    assert encoder["epd:encoder_requests_received_total"] == 43
    assert encoder["epd:encoder_queued_patches"] == 47
    assert encoder["epd:encoder_cache_hit_tokens_total"] == 53
    assert encoder["epd:mm_cache_evictions_total"] == 59
    assert (encoder["epd:mm_cache_entries"], encoder["epd:mm_cache_bytes"]) == (61, 67)
    assert encoder["epd:encoder_inline_images_total"] == 71 and encoder["epd:encoder_inline_bytes_total"] == 73
    assert encoder["epd:encoder_oldest_queued_seconds"] == 79.5


def _samples(*stats: WorkerStats) -> list:
    registry = WorkerRegistry()
    for s in stats:
        registry.on_ready(Ready(s.worker_id, s.role, f"ipc:///tmp/x/{s.worker_id}.sock", "h"))
        registry.on_stats(s)
    return [sample for family in text_string_to_metric_families(WorkerMetrics(registry).render().decode())
            for sample in family.samples]


def _value(samples, name: str, **labels: str) -> float:
    [value] = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    return value


def test_spec_decode_counters_have_vllm_names_and_positions():
    samples = _samples(WorkerStats("decode-0", "decode", 3, 1, 24, 32, 0, engine=ENGINE))
    assert _value(samples, "epd:spec_decode_num_drafts_total") == 83
    assert _value(samples, "epd:spec_decode_num_draft_tokens_total") == 89
    assert _value(samples, "epd:spec_decode_num_accepted_tokens_total") == 97
    per_pos = "epd:spec_decode_num_accepted_tokens_per_pos_total"
    assert [_value(samples, per_pos, worker="decode-0", position=p) for p in ("0", "1")] == [101, 103]


def test_encoder_histograms_keep_their_buckets():
    samples = _samples(WorkerStats("encoder-0", "encoder", 0, 2, 0, 0, 2, encoder=ENCODER))
    queue = "epd:encoder_queue_time_seconds"
    assert _value(samples, queue + "_bucket", le="0.01") == 0
    assert _value(samples, queue + "_bucket", le="0.025") == 31
    assert (_value(samples, queue + "_count"), _value(samples, queue + "_sum")) == (31, 0.02 * 31)
    pre = "epd:encoder_preprocess_seconds"
    assert [_value(samples, pre + "_bucket", le=le) for le in ("0.25", "0.5", "2.5", "5.0", "+Inf")] == [0, 1, 1, 3, 3]
    assert _value(samples, "epd:encoder_forward_seconds_bucket", le="10.0") == 5
    assert _value(samples, "epd:encoder_forward_seconds_bucket", le="5.0") == 0
    assert _value(samples, "epd:encoder_batch_images_bucket", le="2.0") == 0
    assert _value(samples, "epd:encoder_batch_images_bucket", le="4.0") == 5
    assert _value(samples, "epd:encoder_batch_images_sum") == 15
    transfer = "epd:encoder_transfer_seconds"
    assert _value(samples, transfer + "_count", to="cache") == 3
    assert _value(samples, transfer + "_bucket", to="cache", le="0.0025") == 0
    assert _value(samples, transfer + "_bucket", to="cache", le="0.005") == 3
    assert _value(samples, transfer + "_bucket", to="inline", le="0.001") == 2


def test_encoder_requests_by_outcome():
    samples = _samples(WorkerStats("encoder-0", "encoder", 0, 2, 0, 0, 2, encoder=ENCODER))
    outcomes = {o: _value(samples, "epd:encoder_requests_total", worker="encoder-0", outcome=o)
                for o in ("encoded", "cache_hit", "error", "aborted")}
    assert outcomes == {"encoded": 17, "cache_hit": 23, "error": 19, "aborted": 41}


def test_encoder_work_by_modality():
    """Items, frames decoded and decode seconds, each labelled image or video, from the
    counters' per-modality part (transport/wire/wire_values.ModalityCounters), sent over the wire."""
    from epd.transport.wire.codec import Fields

    counters = EncoderCounters(num_images=5)
    counters.image.num_items, counters.video.num_items = 3, 2
    for _ in range(3):
        counters.image.observe_decode(1, 0.002)
    counters.video.observe_decode(40, 0.3)
    counters.video.observe_decode(9, 0.04)
    sent = EncoderCounters.from_map(Fields(counters.to_map(), "encoder"))
    samples = _samples(WorkerStats("encoder-0", "encoder", 0, 0, 0, 0, 0, encoder=sent))
    by_modality = {m: (_value(samples, "epd:encoder_items_total", modality=m),
                       _value(samples, "epd:encoder_frames_decoded_total", modality=m),
                       _value(samples, "epd:encoder_decode_seconds_count", modality=m))
                   for m in ("image", "video")}
    assert by_modality == {"image": (3, 3, 3), "video": (2, 49, 2)}
    decode = "epd:encoder_decode_seconds"
    assert _value(samples, decode + "_bucket", modality="image", le="0.0025") == 3
    assert [_value(samples, decode + "_bucket", modality="video", le=le) for le in ("0.025", "0.05", "0.5")] \
        == [0, 1, 2]
    assert abs(_value(samples, decode + "_sum", modality="video") - 0.34) < 1e-9


def test_api_side_image_metrics():
    registry = WorkerRegistry()
    metrics = WorkerMetrics(registry)
    metrics.mm_cache_hit_tokens += 96
    for n in (1, 1, 3):
        metrics.request_images.observe(n)
    samples = [s for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples]
    assert _value(samples, "epd:mm_cache_hit_tokens_total") == 96
    assert _value(samples, "epd:request_images_bucket", le="1.0") == 2
    assert _value(samples, "epd:request_images_bucket", le="4.0") == 3
    assert _value(samples, "epd:request_images_sum") == 5


def test_a_worker_shows_only_what_its_role_counts():
    samples = _render(WorkerStats("decode-0", "decode", 3, 1, 24, 32, 0, engine=ENGINE),
                      WorkerStats("encoder-0", "encoder", 0, 2, 0, 0, 2, encoder=ENCODER))
    assert not any(name.startswith("epd:encode") for name in samples["decode-0"])
    assert "epd:kv_transfer_bytes_total" not in samples["encoder-0"]
    assert "epd:kv_cache_usage_perc" not in samples["encoder-0"]  # holds no KV cache
    assert samples["decode-0"]["epd:kv_cache_usage_perc"] == 0.25  # 24 of 32 blocks free
    assert (samples["decode-0"]["epd:num_requests_running"], samples["decode-0"]["epd:num_requests_waiting"]) == (3, 1)


def test_cache_faults_are_exported_once_per_worker_of_any_role():
    faults = CacheFaults(serving=0, set_aside=83, read_errors=89, bad_entries=97, space_failures=101,
                         skipped_puts=103)
    samples = _samples(WorkerStats("decode-0", "decode", 0, 0, 8, 8, 0, engine=ENGINE, cache=faults),
                       WorkerStats("encoder-0", "encoder", 0, 0, 0, 0, 0, encoder=ENCODER, cache=CacheFaults()),
                       WorkerStats("prefill-0", "prefill", 0, 0, 8, 8, 0, engine=ENGINE))  # no cache
    names = {"epd:mm_cache_serving": 0, "epd:mm_cache_set_aside_total": 83, "epd:mm_cache_read_errors_total": 89,
             "epd:mm_cache_bad_entries_total": 97, "epd:mm_cache_space_failures_total": 101,
             "epd:mm_cache_skipped_puts_total": 103}
    assert {name: _value(samples, name, worker="decode-0") for name in names} == names
    assert _value(samples, "epd:mm_cache_serving", worker="encoder-0") == 1
    assert not [s for s in samples if s.name.startswith("epd:mm_cache_s") and s.labels.get("worker") == "prefill-0"]
    rendered = [s for s in samples if s.labels.get("worker") == "decode-0"]
    assert len({(s.name, tuple(sorted(s.labels.items()))) for s in rendered}) == len(rendered)  # no duplicates


def test_lora_requests_info_as_vllms_per_engine_worker():
    import time

    from epd.transport.wire.wire_values import LoRAState

    before = time.time()
    samples = _samples(WorkerStats("decode-0", "decode", 2, 1, 8, 8, 0, engine=ENGINE,
                                   lora=LoRAState(("chat", "sql"), ("math",), ("sql", "chat"), 2)),
                       WorkerStats("prefill-0", "prefill", 0, 0, 8, 8, 0, engine=ENGINE,
                                   lora=LoRAState(max_lora=2)),
                       WorkerStats("pd-0", "pd", 0, 0, 8, 8, 0, engine=ENGINE),  # LoRA off: no sample
                       WorkerStats("encoder-0", "encoder", 0, 1, 0, 0, 1,  # tower adapters: the router's, no sample
                                   lora=LoRAState(waiting=("sql",), resident=("sql",), max_lora=2)))
    info = {s.labels["worker"]: s for s in samples if s.name == "epd:lora_requests_info"}
    assert sorted(info) == ["decode-0", "prefill-0"]
    assert {k: v for k, v in info["decode-0"].labels.items() if k not in ("role", "worker")} == \
        {"running_lora_adapters": "chat,sql", "waiting_lora_adapters": "math", "max_lora": "2"}
    assert info["prefill-0"].labels["running_lora_adapters"] == "" and info["prefill-0"].labels["max_lora"] == "2"
    assert before - 1 <= info["decode-0"].value <= time.time() + 1  # the report's time, as vLLM's gauge


def test_a_worker_with_a_state_cache_shows_its_usage_and_the_wire_keeps_its_slots():
    import pytest

    from epd.transport.wire.codec import WireError

    stats = WorkerStats("pd-0", "pd", 1, 0, 8, 8, 0, engine=ENGINE, num_state_slots=4, num_free_state_slots=3)
    assert WorkerStats.from_wire(stats.to_wire()) == stats
    samples = _render(stats, WorkerStats("decode-0", "decode", 3, 1, 24, 32, 0, engine=ENGINE))
    assert samples["pd-0"]["epd:state_cache_usage_perc"] == 0.25  # 1 of 4 slots held
    assert "epd:state_cache_usage_perc" not in samples["decode-0"]  # a model with KV only
    bad = WorkerStats("pd-0", "pd", 1, 0, 8, 8, 0, num_state_slots=2, num_free_state_slots=3)
    with pytest.raises(WireError, match="state slots"):
        WorkerStats.from_wire(bad.to_wire())
