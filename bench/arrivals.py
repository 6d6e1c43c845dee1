"""Request arrival times for an open-loop load: Poisson or gamma, seeded.

Inter-arrival gaps follow a gamma distribution with shape `burstiness` and
mean `1 / request_rate` (scale = 1 / (rate * burstiness)), as in vLLM's
`bench serve`: burstiness 1 is a Poisson process, below 1 is burstier, above
1 is more regular, and infinite burstiness gives evenly spaced arrivals.
An infinite rate sends every request at t = 0.
"""
from __future__ import annotations

import math

import numpy as np


def parse_rate(text: str) -> float:
    """'inf' or a positive number of requests per second (argparse type)."""
    try:
        rate = float(text)
    except ValueError:
        raise ValueError(f"request rate must be a number or 'inf', got {text!r}") from None
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, got {text!r}")
    return rate


def arrival_times_s(num_requests: int, request_rate: float, burstiness: float = 1.0,
                    seed: int = 0, normalize: bool = True) -> list[float]:
    """Send time of each request in seconds from the start of the run, non-decreasing.

    With `normalize` (vLLM's default) the cumulative times are rescaled so
    the last request is sent at exactly `num_requests / request_rate`: the
    offered load of a run is then exactly the requested rate whatever the
    seed, while the shape of the gaps (and so burstiness) is kept.
    """
    if num_requests < 0:
        raise ValueError(f"number of requests must be >= 0, got {num_requests}")
    if not request_rate > 0:
        raise ValueError(f"request rate must be > 0, got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if num_requests == 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if math.isinf(burstiness):
        gaps_s = np.full(num_requests, 1.0 / request_rate)
    else:
        rng = np.random.default_rng(seed)
        gaps_s = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    times_s = np.cumsum(gaps_s)
    if normalize and times_s[-1] > 0:
        times_s *= (num_requests / request_rate) / times_s[-1]
    return times_s.tolist()
