"""Arrival times: seeded, Poisson rate, gamma burstiness, infinite rate."""
from __future__ import annotations

import math

import numpy as np
import pytest

from epd.bench.arrivals import arrival_times_s, parse_rate


def _gaps(times_s: list[float]) -> np.ndarray:
    return np.diff(np.concatenate([[0.0], times_s]))


def test_same_seed_same_times_other_seed_other_times():
    a = arrival_times_s(100, 5.0, seed=7)
    assert a == arrival_times_s(100, 5.0, seed=7)
    assert a != arrival_times_s(100, 5.0, seed=8)
    assert all(x <= y for x, y in zip(a, a[1:]))


def test_infinite_rate_sends_everything_at_zero():
    assert arrival_times_s(5, math.inf) == [0.0] * 5
    assert arrival_times_s(0, 3.0) == []


def test_poisson_mean_rate_and_exponential_gaps():
    gaps = _gaps(arrival_times_s(20_000, 10.0, burstiness=1.0, seed=0, normalize=False))
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV = 1


def test_normalized_schedule_ends_at_n_over_rate():
    times = arrival_times_s(50, 4.0, seed=3)
    assert times[-1] == pytest.approx(50 / 4.0)
    assert len(times) == 50 and times[0] > 0


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_burstiness_sets_gap_variance_at_the_same_mean(burstiness):
    gaps = _gaps(arrival_times_s(20_000, 10.0, burstiness=burstiness, seed=1, normalize=False))
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    assert (gaps.std() / gaps.mean()) ** 2 == pytest.approx(1.0 / burstiness, rel=0.1)  # gamma: CV^2 = 1/k


def test_burstier_traffic_has_more_variance():
    cv = {b: np.std(_gaps(arrival_times_s(5000, 10.0, burstiness=b, seed=2))) for b in (0.5, 1.0, 2.0)}
    assert cv[0.5] > cv[1.0] > cv[2.0]
    even = _gaps(arrival_times_s(10, 2.0, burstiness=math.inf))
    assert np.allclose(even, 0.5)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="rate"):
        arrival_times_s(3, 0.0)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_times_s(3, 1.0, burstiness=0.0)
    assert parse_rate("inf") == math.inf
    assert parse_rate("2.5") == 2.5
    for bad in ("fast", "0", "-1"):
        with pytest.raises(ValueError, match="request rate"):
            parse_rate(bad)
