"""`SentSinceStats`: the requests sent to each worker since its latest stats.

A worker's stats say how many requests it holds when it last reported; a burst
routed between two reports would all land on the worker that looked least
loaded. The routers that choose by load (router.py `LeastRequestsRouter`,
cache_aware_router.py) add what they sent it since, and a new report (a new
stats object) counts what it has received.
"""
from __future__ import annotations


class SentSinceStats:
    def __init__(self):
        self._sent: dict[str, tuple[object, int]] = {}  # worker id -> (stats it was counted against, sent since)

    def count(self, worker) -> int:
        """Requests sent to `worker` since its latest stats."""
        stats, num_sent = self._sent.get(worker.worker_id, (None, 0))
        return num_sent if stats is worker.stats else 0  # a new report counts what it has received

    def add(self, worker) -> None:
        """One more request sent to `worker`."""
        self._sent[worker.worker_id] = (worker.stats, self.count(worker) + 1)
