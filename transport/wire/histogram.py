"""A histogram a worker fills and sends whole, for the API to export.

Workers are separate processes (perhaps on other hosts) and cannot serve
Prometheus themselves. Each keeps, per histogram, a count per bucket and the
sum of what it observed since it started, and sends them in every
`WorkerStats` (transport/wire/wire_values.py); the API exports the latest as a
Prometheus histogram. Why not per-observation messages: the wire stays the
same size whatever the traffic (a few dozen ints per histogram), a lost or
late report loses nothing (the next one carries the totals), and a restarted
worker simply starts again from zero, like every other worker counter.

Bucket bounds are constants both sides know (`ENCODER_SECONDS_BOUNDS`, ...);
only the counts cross the wire, checked against the bounds' length.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from epd.transport.wire.codec import WireError

# seconds: an image's queue wait, a batch's preprocessing or ViT forward, one transfer
ENCODER_SECONDS_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
                          40.0, 80.0)
# images in one encoder batch, or in one request
IMAGE_COUNT_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass
class Buckets:
    """Observations of one histogram: `counts[i]` fell in (bounds[i-1], bounds[i]];
    the last count is above every bound (+Inf)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)
        assert len(self.counts) == len(self.bounds) + 1

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """Prometheus buckets: (upper bound, observations at or below it), infinity last."""
        out, total = [], 0
        for bound, n in zip([*self.bounds, math.inf], self.counts):
            total += n
            out.append((bound, total))
        return out

    def to_list(self) -> list:
        """[sum, count per bucket ...]."""
        return [self.sum, *self.counts]

    @staticmethod
    def from_list(value, bounds: tuple[float, ...], where: str) -> Buckets:
        if not (isinstance(value, list) and len(value) == len(bounds) + 2 and type(value[0]) in (int, float)
                and value[0] >= 0 and all(type(n) is int and n >= 0 for n in value[1:])):
            raise WireError(f"{where}: expected [sum >= 0, {len(bounds) + 1} counts >= 0]")
        return Buckets(bounds, list(value[1:]), float(value[0]))
