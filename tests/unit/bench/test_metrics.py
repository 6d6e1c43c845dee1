"""Serving metrics on synthetic per-request results: TPOT, percentiles, goodput, rate sweeps."""
from __future__ import annotations

import math

import numpy as np
import pytest

from epd.bench.client import RequestResult
from epd.bench.metrics import (attainment_ci, compute_metrics, distserve_max_rate, distserve_rate_ci, meets_slos,
                               p99_max_rate, parse_goodput, parse_percentiles, request_tpot_ms, slo_attainment,
                               tail_latencies_ms)


def make_result(ttft_ms: float = 100.0, tpot_ms: float = 10.0, output_len: int = 11, *, success: bool = True,
                input_len: int = 50, num_images: int = 0) -> RequestResult:
    """A completed request whose E2EL gives exactly `tpot_ms` per token after the first."""
    e2el_ms = ttft_ms + tpot_ms * max(output_len - 1, 0)
    return RequestResult(success=success, ttft_s=ttft_ms / 1000, e2el_s=e2el_ms / 1000,
                         itls_s=[tpot_ms / 1000] * max(output_len - 1, 0), input_len=input_len,
                         output_len=output_len if success else 0, num_images=num_images,
                         error="" if success else "HTTP 500: boom")


def test_tpot_is_undefined_for_zero_and_one_token_outputs():
    assert request_tpot_ms(make_result(output_len=0)) is None
    assert request_tpot_ms(make_result(output_len=1)) is None
    assert request_tpot_ms(make_result(success=False)) is None
    two = RequestResult(success=True, ttft_s=0.1, e2el_s=0.13, output_len=2)
    assert request_tpot_ms(two) == pytest.approx(30.0)  # (130 - 100) / (2 - 1)
    five = RequestResult(success=True, ttft_s=0.1, e2el_s=0.18, output_len=5)
    assert request_tpot_ms(five) == pytest.approx(20.0)  # 80 / 4


def test_tpot_statistics_leave_out_short_outputs():
    results = [make_result(tpot_ms=10, output_len=2), make_result(tpot_ms=30, output_len=3),
               make_result(output_len=1), make_result(output_len=0)]
    m = compute_metrics(results, duration_s=1.0, percentiles=[50])
    assert m["mean_tpot_ms"] == pytest.approx(20.0)
    assert m["p50_tpot_ms"] == pytest.approx(20.0)
    assert m["completed"] == 4
    assert m["total_output_tokens"] == 2 + 3 + 1 + 0


def test_percentiles_match_numpy_linear():
    rng = np.random.default_rng(0)
    ttfts_ms = rng.exponential(200.0, size=257)
    e2els_extra_ms = rng.exponential(500.0, size=257)
    results = [RequestResult(success=True, ttft_s=t / 1000, e2el_s=(t + e) / 1000, output_len=9,
                             itls_s=[e / 8000] * 8) for t, e in zip(ttfts_ms, e2els_extra_ms)]
    qs = [50, 90, 99, 99.9]
    m = compute_metrics(results, duration_s=10.0, percentiles=qs)
    for q, key in zip(qs, ["p50", "p90", "p99", "p99.9"]):
        assert m[f"{key}_ttft_ms"] == pytest.approx(np.percentile(ttfts_ms, q))
        assert m[f"{key}_e2el_ms"] == pytest.approx(np.percentile(ttfts_ms + e2els_extra_ms, q))
        assert m[f"{key}_tpot_ms"] == pytest.approx(np.percentile(e2els_extra_ms / 8, q))
    assert m["mean_ttft_ms"] == pytest.approx(ttfts_ms.mean())
    assert m["median_ttft_ms"] == pytest.approx(np.median(ttfts_ms))
    assert m["std_ttft_ms"] == pytest.approx(ttfts_ms.std())
    assert m["mean_itl_ms"] == pytest.approx((e2els_extra_ms / 8).mean())  # pooled, 8 equal gaps each


def test_throughput_counts_only_completed_requests():
    results = [make_result(output_len=4, input_len=10), make_result(output_len=6, input_len=20),
               make_result(success=False, input_len=999)]
    m = compute_metrics(results, duration_s=2.0, percentiles=[99])
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 10)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(5.0)
    assert m["total_token_throughput"] == pytest.approx(20.0)
    assert m["request_goodput"] is None  # no SLOs given


GOODPUT_RESULTS = [
    make_result(ttft_ms=100, tpot_ms=10, output_len=11),    # e2el 200
    make_result(ttft_ms=600, tpot_ms=10, output_len=11),    # slow first token, e2el 700
    make_result(ttft_ms=100, tpot_ms=80, output_len=11),    # slow decode, e2el 900
    make_result(ttft_ms=100, tpot_ms=999, output_len=1),    # one token: TPOT counts as 0, e2el 100
    make_result(success=False),                             # never good
]


@pytest.mark.parametrize("slos, num_good", [
    ({"ttft": 500}, 3),
    ({"tpot": 50}, 3),
    ({"e2el": 800}, 3),
    ({"ttft": 500, "tpot": 50}, 2),
    ({"ttft": 1000, "tpot": 100, "e2el": 250}, 2),
    ({"ttft": 50}, 0),
    ({"ttft": 1000, "tpot": 100, "e2el": 1000}, 4),
])
def test_goodput_counts_requests_meeting_every_given_slo(slos, num_good):
    m = compute_metrics(GOODPUT_RESULTS, duration_s=4.0, percentiles=[99], slos_ms=slos)
    assert m["request_goodput"] == pytest.approx(num_good / 4.0)
    assert sum(meets_slos(r, slos) for r in GOODPUT_RESULTS) == num_good


def test_slo_boundary_is_inclusive():
    assert meets_slos(make_result(ttft_ms=500), {"ttft": 500})
    assert not meets_slos(make_result(ttft_ms=500.5), {"ttft": 500})


def test_text_only_and_image_ttft_are_split_for_mixed_traffic():
    results = [make_result(ttft_ms=100, num_images=0), make_result(ttft_ms=120, num_images=0),
               make_result(ttft_ms=400, num_images=1), make_result(ttft_ms=600, num_images=2)]
    m = compute_metrics(results, duration_s=1.0, percentiles=[99])
    assert (m["num_text_only_completed"], m["num_image_completed"]) == (2, 2)
    assert m["text_only_mean_ttft_ms"] == pytest.approx(110.0)
    assert m["image_mean_ttft_ms"] == pytest.approx(500.0)
    assert m["image_p99_ttft_ms"] == pytest.approx(np.percentile([400, 600], 99))
    assert "text_only_mean_ttft_ms" not in compute_metrics(results[:2], 1.0)  # not mixed: no split


def _run(num_ok: int, *, slow: int = 0, failed: int = 0, slow_ttft_ms: float = 900.0,
         slow_tpot_ms: float = 10.0) -> list[RequestResult]:
    return ([make_result(ttft_ms=100, tpot_ms=10) for _ in range(num_ok)]
            + [make_result(ttft_ms=slow_ttft_ms, tpot_ms=slow_tpot_ms) for _ in range(slow)]
            + [make_result(success=False) for _ in range(failed)])


def test_distserve_rate_is_highest_with_90_percent_attainment():
    sweep = [(1.0, _run(10)), (2.0, _run(9, slow=1)), (3.0, _run(8, slow=2)), (4.0, _run(5, slow=5))]
    assert [slo_attainment(r, 500, 50) for _, r in sweep] == [1.0, 0.9, 0.8, 0.5]
    assert distserve_max_rate(sweep, ttft_slo_ms=500, tpot_slo_ms=50) == 2.0
    assert distserve_max_rate(sweep, ttft_slo_ms=1000, tpot_slo_ms=50) == 4.0
    assert distserve_max_rate(sweep, ttft_slo_ms=50, tpot_slo_ms=50) == 0.0
    # a failed request is a miss
    assert distserve_max_rate([(1.0, _run(9, failed=1)), (2.0, _run(8, failed=2))], 500, 50) == 1.0
    # TPOT counts too
    assert distserve_max_rate([(1.0, _run(10)), (2.0, _run(5, slow=5, slow_ttft_ms=100, slow_tpot_ms=90))],
                              500, 50) == 1.0


def test_p99_rate_is_highest_with_p99_ttft_and_tpot_within_slo():
    # 100 requests: one slow one moves P99 only by 1% of the gap (linear), two slow ones set it
    one_slow, two_slow = _run(99, slow=1), _run(98, slow=2)
    assert tail_latencies_ms(one_slow)[0] == pytest.approx(100 + 0.01 * 800)
    assert tail_latencies_ms(two_slow)[0] == pytest.approx(900)
    sweep = [(1.0, _run(100)), (2.0, one_slow), (3.0, two_slow)]
    assert p99_max_rate(sweep, ttft_slo_ms=500, tpot_slo_ms=50) == 2.0
    # the DistServe rule accepts the 98% run as well: the two definitions differ
    assert distserve_max_rate(sweep, ttft_slo_ms=500, tpot_slo_ms=50) == 3.0
    # a TPOT tail alone fails a rate
    tpot_tail = _run(98, slow=2, slow_ttft_ms=100, slow_tpot_ms=90)
    assert p99_max_rate([(1.0, _run(100)), (2.0, tpot_tail)], 500, 50) == 1.0
    # one failure in 100 makes P99 infinite
    assert tail_latencies_ms(_run(99, failed=1))[0] == math.inf
    assert p99_max_rate([(5.0, _run(99, failed=1))], 500, 50) == 0.0
    assert p99_max_rate([], 500, 50) == 0.0


def test_parse_goodput_and_percentiles():
    assert parse_goodput(["ttft:500", "tpot:50.5", "e2el:0"]) == {"ttft": 500.0, "tpot": 50.5, "e2el": 0.0}
    for bad in (["itl:5"], ["ttft"], ["ttft:abc"], ["ttft:-1"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput(bad)
    assert parse_percentiles("50,90,99.9") == [50.0, 90.0, 99.9]
    for bad in ("", "0", "101", "a,b"):
        with pytest.raises(ValueError, match="percentiles"):
            parse_percentiles(bad)


def _run_with_attainment(num_met: int, num_missed: int) -> list[RequestResult]:
    """Requests of which `num_met` meet TTFT 500 ms / TPOT 50 ms; the missed ones alternate
    between a slow first token, a slow decode and a failure."""
    missed = [make_result(ttft_ms=900), make_result(tpot_ms=80), make_result(success=False)]
    return [make_result()] * num_met + [missed[i % 3] for i in range(num_missed)]


def test_attainment_interval_holds_the_estimate_and_narrows_with_more_requests():
    widths = []
    for n in (10, 40, 160):
        results = _run_with_attainment(n * 8 // 10, n - n * 8 // 10)  # 80% met
        lo, hi = attainment_ci(results, 500, 50)
        point = slo_attainment(results, 500, 50)
        assert point == pytest.approx(0.8)
        assert lo < point < hi
        widths.append(hi - lo)
    assert widths[0] > widths[1] > widths[2]
    # a binomial's standard error: sqrt(0.8 * 0.2 / n); the 95% interval is about 4 of them wide
    for n, width in zip((40, 160), widths[1:]):
        assert width == pytest.approx(4 * math.sqrt(0.16 / n), rel=0.2)


def test_attainment_interval_is_seeded_and_degenerate_when_every_request_agrees():
    results = _run_with_attainment(30, 10)
    assert attainment_ci(results, 500, 50, seed=3) == attainment_ci(results, 500, 50, seed=3)
    assert attainment_ci(_run_with_attainment(20, 0), 500, 50) == (1.0, 1.0)
    assert attainment_ci(_run_with_attainment(0, 20), 500, 50) == (0.0, 0.0)


def test_goodput_interval_spans_the_tested_rates_a_resample_could_pass():
    # 100% at 0.1, 90% (just passing) at 0.2, 50% at 0.4: goodput 0.2, and a resample of the
    # 0.2 run falls under 90% about half the time -> the interval reaches down to 0.1
    sweep = [(0.1, _run_with_attainment(40, 0)), (0.2, _run_with_attainment(36, 4)),
             (0.4, _run_with_attainment(20, 20))]
    assert distserve_max_rate(sweep, 500, 50) == 0.2
    assert distserve_rate_ci(sweep, 500, 50) == (0.1, 0.2)
    # clear margins at every rate: no resample changes the answer
    sweep = [(0.1, _run_with_attainment(40, 0)), (0.2, _run_with_attainment(40, 0)),
             (0.4, _run_with_attainment(4, 36))]
    assert distserve_rate_ci(sweep, 500, 50) == (0.2, 0.2)
