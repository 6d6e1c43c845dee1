"""The scheduler's order of requests: arrival, and the prefill priority of
`prefill_priority="cost"` (pure Python, no torch).

Split from `Scheduler` so that what orders the queues (arrival keys, the
work scheduled before each arrival, the aged cost) lives apart from what
allocates blocks; the scheduler registers each request here when it is
added and forgets it when it finishes or is released.
"""
from __future__ import annotations

from epd.engine.request import Request
from epd.engine.scheduler_config import SchedulerConfig


class PrefillOrder:
    """Arrival keys and prefill priorities of the requests a scheduler holds."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._arrival_keys: dict[str, tuple[float, int]] = {}
        self._arrival_work: dict[str, int] = {}  # request id -> tokens scheduled before it arrived
        self._num_added = 0

    def add(self, request: Request, num_scheduled_tokens: int) -> None:
        """Register `request`, arriving after `num_scheduled_tokens` tokens of work."""
        self._arrival_keys[request.request_id] = (request.arrival_time, self._num_added)
        self._arrival_work[request.request_id] = num_scheduled_tokens
        self._num_added += 1

    def forget(self, request_id: str) -> None:
        del self._arrival_keys[request_id]
        del self._arrival_work[request_id]

    def arrival_key(self, request: Request) -> tuple[float, int]:
        """Arrival time, ties broken by the order of adding."""
        return self._arrival_keys[request.request_id]

    def priority(self, request: Request) -> tuple[float, tuple[float, int]]:
        """Prefill order under "cost", lowest first: tokens left to prefill
        plus `prefill_aging` x the tokens scheduled before it arrived, i.e.

            priority = (num_tokens - num_computed_tokens) + aging * W_arrival

        A request that arrives W tokens of work after X overtakes X only
        while its own cost is below X's by more than aging x W: X is passed
        only by requests arriving within cost(X) / aging scheduled tokens
        after it (with aging 0.1, a 2,000-token prompt by those arriving
        within the next 20,000 tokens of work), so no prefill starves. Ties
        go by arrival. Under "fcfs" arrival alone."""
        if self.config.prefill_priority == "fcfs":
            return 0.0, self.arrival_key(request)
        cost = request.num_tokens - request.num_computed_tokens
        return (cost + self.config.prefill_aging * self._arrival_work[request.request_id],
                self.arrival_key(request))
