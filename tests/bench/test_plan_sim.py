"""The planner's simulation against hand calculations, on synthetic service times (ms)."""
from __future__ import annotations

import pytest

from epd.bench.plan_sim import (ServiceTimes, SimConfig, Split, Workload, max_goodput, predicted_goodput,
                                simulate, simulate_arrivals, splits)

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
