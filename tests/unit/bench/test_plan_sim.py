"""The planner's simulation against hand calculations, on synthetic service times (ms)."""
from __future__ import annotations

import pytest

from epd.bench.datasets import sample_random_mm
from epd.bench.plan_inputs import ServiceTimes, Split, Workload, splits, text_only_requests
from epd.bench.plan_sim import SimConfig, max_goodput, predicted_goodput, simulate, simulate_arrivals

TIMES = ServiceTimes(encode_ms_per_image=100, prefill_ms_per_token=1.0, decode_step_ms=10, kv_transfer_ms=5)
FOUR_IMAGES = Workload(images_per_request=4, prompt_tokens=200, output_len=11)


def test_splits_of_three_and_four_workers():
    assert [s.label for s in splits(3)] == ["3A", "2E1PD", "1E2PD", "1E1P1D"]
    assert [s.label for s in splits(4)] == ["4A", "3E1PD", "2E2PD", "1E3PD",
                                            "2E1P1D", "1E1P2D", "1E2P1D"]
    assert Split("e-p-d", 2, 1, 1).worker_args() == ["--prefill", "1", "--encoders", "2", "--decode", "1"]
    assert Split("e-pd", 1, 2).worker_args() == ["--prefill", "2", "--encoders", "1"]
    assert Split("aggregated", prefill=3).worker_args() == ["--prefill", "3"]
    with pytest.raises(ValueError, match="--workers"):
        splits(0)


@pytest.mark.parametrize("split, ttft_ms, tpot_ms", [
    # four images on two encoders: two encode times; 200 tokens of prefill; KV hop once over 10 steps
    (Split("e-p-d", 2, 1, 1), 2 * 100 + 200, (5 + 10 * 10) / 10),
    (Split("e-p-d", 1, 1, 1), 4 * 100 + 200, (5 + 10 * 10) / 10),
    (Split("e-pd", 1, 1), 4 * 100 + 200, 10),  # no KV moves
    (Split("aggregated", prefill=1), 4 * 100 + 200, 10),  # encoded inline, then prefilled
])
def test_a_request_alone_takes_the_sum_of_its_stages(split, ttft_ms, tpot_ms):
    (alone,) = simulate_arrivals(split, TIMES, FOUR_IMAGES, [0.0])
    assert alone.ttft_ms == pytest.approx(ttft_ms)
    assert alone.tpot_ms == pytest.approx(tpot_ms)


def test_an_inline_encode_stalls_the_aggregated_workers_decodes():
    # B arrives while A decodes: its four images are encoded between A's steps
    one_image = Workload(images_per_request=1, prompt_tokens=100, output_len=11)
    a, b = simulate_arrivals(Split("aggregated", prefill=1), TIMES, one_image, [0.0, 205.0])
    assert a.ttft_ms == pytest.approx(200)
    # A's steps end at 210, then B's encode (100) and a step with B's prefill (10 + 100) -> 420
    assert a.tpot_ms == pytest.approx((420 - 200 + 8 * 10) / 10)
    assert b.ttft_ms == pytest.approx(420 - 205)
    # e-p-d: A's decode worker never waits (B's KV arrives during its steps and joins the batch)
    a, b = simulate_arrivals(Split("e-p-d", 1, 1, 1), TIMES, one_image, [0.0, 205.0])
    assert a.tpot_ms == pytest.approx((5 + 10 * 10) / 10)
    assert b.ttft_ms == pytest.approx(200)


def test_shared_cores_split_between_busy_workers_by_weight():
    one_image = Workload(images_per_request=1, prompt_tokens=100, output_len=11)
    times = ServiceTimes(encode_ms_per_image=100, prefill_ms_per_token=1.0, decode_step_ms=10)
    # two encoders busy at once on shared cores, equal weight: each at half speed (200 ms),
    # then the prefill worker alone prefills both in one step (200 ms)
    equal = SimConfig(shared_cores=True)
    a, b = simulate_arrivals(Split("e-p-d", 2, 1, 1), times, one_image, [0.0, 0.0], equal)
    assert a.ttft_ms == b.ttft_ms == pytest.approx(400)
    a, b = simulate_arrivals(Split("e-p-d", 2, 1, 1), times, one_image, [0.0, 0.0])  # a device each
    assert a.ttft_ms == b.ttft_ms == pytest.approx(300)
    # decode (nice 0, weight 1024) against an encode (nice 4, weight 423): A's steps take
    # 1447/1024 as long while B's image is encoded; the work done is conserved
    niced = SimConfig(shared_cores=True, nice={"encoder": 4, "prefill": 2, "decode": 0})
    a, b = simulate_arrivals(Split("e-p-d", 1, 1, 1), times, one_image, [0.0, 200.0], niced)
    assert a.ttft_ms == pytest.approx(200)
    assert a.tpot_ms == pytest.approx(10 * 1447 / 1024)
    assert b.ttft_ms == pytest.approx(100 + 100 + 100)  # A's 100 ms of decode, B's encode, B's prefill
    assert b.tpot_ms == pytest.approx(10)


def test_on_several_cores_each_busy_thread_gets_at_most_one_core():
    times = ServiceTimes(encode_ms_per_image=100, prefill_ms_per_token=1.0, decode_step_ms=10)  # one thread's
    one_image = Workload(images_per_request=1, prompt_tokens=100, output_len=11)
    # two cores, one thread a worker (epd serve keeps one of 2 for the API): the two encoders
    # run side by side at full speed, as on devices of their own
    two = SimConfig(shared_cores=True, cores=2)
    a, b = simulate_arrivals(Split("e-p-d", 2, 1, 1), times, one_image, [0.0, 0.0], two)
    assert a.ttft_ms == b.ttft_ms == pytest.approx(100 + 200)
    # three images on three encoders at once: three threads on two cores, 2/3 of a core each
    three_images = Workload(images_per_request=3, prompt_tokens=100, output_len=11)
    (alone,) = simulate_arrivals(Split("e-p-d", 3, 1, 1), times, three_images, [0.0], two)
    assert alone.ttft_ms == pytest.approx(100 * 3 / 2 + 100)
    # four cores: serve gives the encoder the 3 cores left after the API's, each engine worker
    # 3 // 2 = 1 thread; so the image takes a third of one thread's time, the prefill all of it
    four = SimConfig(shared_cores=True, cores=4)
    (alone,) = simulate_arrivals(Split("e-p-d", 1, 1, 1), times, one_image, [0.0], four)
    assert alone.ttft_ms == pytest.approx(100 / 3 + 100)
    # --threads-per-worker 2: every stage twice as fast as one thread while it has two cores
    pinned = SimConfig(shared_cores=True, cores=4, threads_per_worker=2)
    (alone,) = simulate_arrivals(Split("e-p-d", 1, 1, 1), times, one_image, [0.0], pinned)
    assert alone.ttft_ms == pytest.approx(50 + 50)
    # decode (weight 1024) and an encode (423) on two cores: each has a core, nobody slows;
    # on one core they share it by weight (the test above)
    niced = SimConfig(shared_cores=True, cores=2, nice={"encoder": 4, "prefill": 2, "decode": 0})
    a, b = simulate_arrivals(Split("e-p-d", 1, 1, 1), times, one_image, [0.0, 200.0], niced)
    assert a.tpot_ms == pytest.approx(10)
    assert b.ttft_ms == pytest.approx(100 + 100)


def test_the_request_overhead_is_the_api_processs_work_in_arrival_order():
    times = ServiceTimes(encode_ms_per_image=100, prefill_ms_per_token=1.0, decode_step_ms=10,
                         request_overhead_ms=10)
    one_image = Workload(images_per_request=1, prompt_tokens=100, output_len=11)
    # devices of their own: A through the API 0-10, encoded 10-110, prefilled 110-210; B waits for
    # the API (10-20), is encoded on the second encoder 20-120 and prefilled after A, 210-310
    a, b = simulate_arrivals(Split("e-p-d", 2, 1, 1), times, one_image, [0.0, 0.0])
    assert (a.ttft_ms, b.ttft_ms) == (pytest.approx(210), pytest.approx(310))
    # text only, one aggregated worker, one shared core: B's 10 ms in the API (10-30) run beside
    # A's prefill at half speed each, so A's prefill ends at 120, not 110; then one step of A's
    # decode and B's prefill (110 ms) alone
    text = Workload(images_per_request=0, prompt_tokens=100, output_len=11)
    a, b = simulate_arrivals(Split("aggregated", prefill=1), times, text, [0.0, 0.0], SimConfig(shared_cores=True))
    assert (a.ttft_ms, b.ttft_ms) == (pytest.approx(120), pytest.approx(230))


SLOS = {"ttft_slo_ms": 4000.0, "tpot_slo_ms": 100.0}


def _best(candidates, times, workload, **slos):
    kwargs = dict(num_requests=40, seeds=[0, 1, 2], **(slos or SLOS))
    goodput = {s.label: max_goodput(s, times, workload, high=10.0, steps=8, **kwargs) for s in candidates}
    return max(goodput, key=goodput.get), goodput


def test_encode_bound_one_more_encoder_beats_one_more_prefill_or_decode():
    # four images of 500 ms: one encoder finishes 0.5 requests/s, two finish 1.0; prefill
    # (50 ms) and decode (10 ms steps) are far from full. By hand: 2E1P1D, the only split whose
    # bottleneck passes 0.5/s; the others cannot reach it.
    times = ServiceTimes(encode_ms_per_image=500, prefill_ms_per_token=0.25, decode_step_ms=10, kv_transfer_ms=1)
    workload = Workload(images_per_request=4, prompt_tokens=200, output_len=16)
    e_p_d = [s for s in splits(4) if s.mode == "e-p-d"]
    best, goodput = _best(e_p_d, times, workload)
    assert best == "2E1P1D"
    assert goodput["2E1P1D"] > 0.5 > max(goodput["1E2P1D"], goodput["1E1P2D"])


def test_decode_bound_one_more_decode_worker_beats_one_more_encoder():
    # a decode step of 20 ms + 20 ms a sequence meets the 70 ms TPOT SLO with at most two
    # sequences; 50 steps of 60 ms hold them 3 s, so one decode worker serves < 2/3 request/s
    # and two serve < 4/3. Encode and prefill are 10 ms each. By hand: 1E1P2D.
    times = ServiceTimes(encode_ms_per_image=10, prefill_ms_per_token=0.1, decode_step_ms=20,
                         decode_ms_per_seq=20)
    workload = Workload(images_per_request=1, prompt_tokens=100, output_len=51)
    e_p_d = [s for s in splits(4) if s.mode == "e-p-d"]
    best, goodput = _best(e_p_d, times, workload, ttft_slo_ms=1000.0, tpot_slo_ms=70.0)
    assert best == "1E1P2D"
    assert goodput["1E1P2D"] > max(goodput["2E1P1D"], goodput["1E2P1D"])
    assert max(goodput["2E1P1D"], goodput["1E2P1D"]) < 2 / 3


def test_on_a_grid_the_goodput_is_the_highest_rate_with_90_percent_attainment():
    times = ServiceTimes(encode_ms_per_image=500, prefill_ms_per_token=0.25, decode_step_ms=10)
    workload = Workload(images_per_request=4, prompt_tokens=200, output_len=16)
    # one encoder: 2 s of encoding a request; far below 0.5/s every request meets 4 s, far above none does
    goodput, per_rate = predicted_goodput(Split("e-p-d", 1, 1, 1), times, workload, [0.05, 0.2, 2.0],
                                          num_requests=40, seeds=[0, 1], **SLOS)
    assert per_rate[0.05] >= 0.95 and per_rate[2.0] < 0.2
    assert goodput == (0.2 if per_rate[0.2] >= 0.9 else 0.05)
    # the same seed is the same trace
    assert simulate(Split("e-p-d", 1, 1, 1), times, workload, 0.3, 20, seed=5) == \
        simulate(Split("e-p-d", 1, 1, 1), times, workload, 0.3, 20, seed=5)


# -- text-only requests and conditional disaggregation (--max-local-prefill-tokens) --

TEXT_300 = Workload(images_per_request=0, prompt_tokens=300, output_len=11)
LOCAL_OFF = SimConfig(max_local_prefill_tokens=0)


@pytest.mark.parametrize("config, prompt_tokens, ttft_ms, tpot_ms", [
    (SimConfig(), 300, 300, 10),  # prefilled on the decode worker: no encoder, no KV moves
    (LOCAL_OFF, 300, 300, (5 + 10 * 10) / 10),  # through the prefill worker: the KV hop once
    (SimConfig(), 600, 600, (5 + 10 * 10) / 10),  # past the 512-token threshold: the prefill worker
    (SimConfig(max_local_prefill_tokens=600), 600, 600, 10),
])
def test_a_short_text_only_request_alone_is_prefilled_on_the_decode_worker(config, prompt_tokens, ttft_ms, tpot_ms):
    workload = Workload(images_per_request=0, prompt_tokens=prompt_tokens, output_len=11)
    (alone,) = simulate_arrivals(Split("e-p-d", 1, 1, 1), TIMES, workload, [0.0], config)
    assert (alone.ttft_ms, alone.tpot_ms, alone.is_text_only) == (pytest.approx(ttft_ms), pytest.approx(tpot_ms), True)


def test_a_text_only_request_of_a_mix_has_its_text_alone_and_no_image():
    # four images and 1200 prompt tokens with images; the same text alone is 300 tokens
    mix = Workload(images_per_request=4, prompt_tokens=1200, output_len=11, text_only_ratio=0.5,
                   text_prompt_tokens=300)
    image, text = simulate_arrivals(Split("e-p-d", 2, 1, 1), TIMES, mix, [0.0, 10_000.0], text_only=[False, True])
    assert (image.ttft_ms, image.is_text_only) == (pytest.approx(2 * 100 + 1200), False)
    assert (text.ttft_ms, text.tpot_ms, text.is_text_only) == (pytest.approx(300), pytest.approx(10), True)
    # aggregated and e-pd: no encode inline either, and the same worker decodes it
    for split in (Split("aggregated", prefill=1), Split("e-pd", 1, 1)):
        (text,) = simulate_arrivals(split, TIMES, mix, [0.0], text_only=[True])
        assert (text.ttft_ms, text.tpot_ms) == (pytest.approx(300), pytest.approx(10))


def test_a_local_prefill_stalls_the_decode_workers_running_request_by_its_length():
    # A (one image, 100 tokens): encoded by 100, prefilled by 200, its KV on the decode worker
    # at 205, steps of 10 ms from then. B (text only, 300 tokens) arrives at 230, mid-step; the
    # step after (235) decodes A and prefills B: 10 + 300 ms, ending at 545.
    mix = Workload(images_per_request=1, prompt_tokens=100, output_len=11, text_only_ratio=0.5,
                   text_prompt_tokens=300)
    a, b = simulate_arrivals(Split("e-p-d", 1, 1, 1), TIMES, mix, [0.0, 230.0], text_only=[False, True])
    assert a.ttft_ms == pytest.approx(200)
    assert a.tpot_ms == pytest.approx((5 + 10 * 10 + 300) / 10)  # A's gap grew by exactly B's prefill
    assert b.ttft_ms == pytest.approx(545 - 230)
    assert b.tpot_ms == pytest.approx(10)
    # off: B goes through the (idle) prefill worker, and A's decodes never wait
    a, b = simulate_arrivals(Split("e-p-d", 1, 1, 1), TIMES, mix, [0.0, 230.0], LOCAL_OFF, text_only=[False, True])
    assert a.tpot_ms == pytest.approx((5 + 10 * 10) / 10)
    assert b.ttft_ms == pytest.approx(300)


def test_a_short_prompt_spills_to_an_idle_prefill_worker_while_every_decode_worker_prefills():
    # 1E1P1D, three 300-token text-only requests at once. The first goes to the decode worker;
    # the second finds it prefilling and the prefill worker idle: the prefill worker takes it
    # (300 ms, then the KV hop); the third finds both prefilling: the decode worker again, whose
    # step computes at most 512 prompt tokens, so it prefills the third in its next step, beside
    # the first's decode: 300 + (10 + 300).
    first, second, third = simulate_arrivals(Split("e-p-d", 1, 1, 1), TIMES, TEXT_300, [0.0, 0.0, 0.0])
    assert first.ttft_ms == second.ttft_ms == pytest.approx(300)
    assert third.ttft_ms == pytest.approx(300 + 10 + 300)
    # the first is stalled once, by the third's prefill; the second's KV reaches the decode
    # worker at 305, during that step (300 to 610), and joins the next
    assert first.tpot_ms == pytest.approx((10 + 300 + 9 * 10) / 10)
    assert second.tpot_ms == pytest.approx((610 - 300 + 10 * 10) / 10)
    # prompts that fit one step together (2 x 200 <= 512): the decode worker takes both at once
    text_200 = Workload(images_per_request=0, prompt_tokens=200, output_len=11)
    first, second = simulate_arrivals(Split("e-p-d", 1, 1, 1), TIMES, text_200, [0.0, 0.0])
    assert first.ttft_ms == second.ttft_ms == pytest.approx(400)
    assert first.tpot_ms == second.tpot_ms == pytest.approx(10)  # no KV hop: both decode where prefilled
    # two decode workers: each prefills one of two at once, nobody spills
    first, second = simulate_arrivals(Split("e-p-d", 1, 1, 2), TIMES, TEXT_300, [0.0, 0.0])
    assert (first.tpot_ms, second.tpot_ms) == (pytest.approx(10), pytest.approx(10))
    # off: both through the prefill worker, in one step of 600 tokens
    first, second = simulate_arrivals(Split("e-p-d", 1, 1, 1), TIMES, TEXT_300, [0.0, 0.0], LOCAL_OFF)
    assert first.ttft_ms == second.ttft_ms == pytest.approx(600)


def test_a_text_only_ratio_draws_the_requests_of_the_real_dataset():
    sizes = ((16, 16), (24, 8))
    mix = Workload(images_per_request=2, prompt_tokens=200, output_len=4, text_only_ratio=0.5,
                   text_prompt_tokens=20, input_len=12, image_sizes=sizes)
    for seed in (0, 7919):
        real = [r.num_images == 0 for r in sample_random_mm(30, 12, 4, images_per_request=2, image_sizes=list(sizes),
                                                            text_only_ratio=0.5, seed=seed)]
        assert list(text_only_requests(mix, 30, seed)) == real
        assert 0 < sum(real) < 30
        outcomes = simulate(Split("e-p-d", 1, 1, 1), TIMES, mix, 1.0, 30, seed=seed)
        assert [o.is_text_only for o in outcomes] == real
    assert text_only_requests(mix, 30, 0) != text_only_requests(mix, 30, 7919)
    assert not any(text_only_requests(FOUR_IMAGES, 30, 0))
    assert all(text_only_requests(TEXT_300, 30, 0))
    with pytest.raises(ValueError, match="text_prompt_tokens"):
        Workload(images_per_request=2, prompt_tokens=200, output_len=4, text_only_ratio=0.5)
