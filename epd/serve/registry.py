"""The API process's view of its workers: addresses, roles, latest load.

Workers announce themselves with `Ready` (spawned by the launcher, or
started elsewhere with `epd worker`, which is how external workers register)
and publish `WorkerStats` a few times a second.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from epd.transport.messages import Ready, WorkerStats

STATS_STALE_S = 5.0  # a worker silent for this long counts as down


@dataclass
class WorkerInfo:
    worker_id: str
    role: str
    inbox: str
    host: str = ""
    mm_cache_dir: str | None = None
    stats: WorkerStats | None = None
    last_seen_s: float = field(default_factory=time.monotonic)

    @property
    def load(self) -> int:
        """Requests on or queued for this worker, from its latest stats."""
        s = self.stats
        return 0 if s is None else s.num_running + s.num_waiting + s.queue_depth

    def shares_cache_with(self, other: "WorkerInfo") -> bool:
        return bool(self.mm_cache_dir) and self.host == other.host and self.mm_cache_dir == other.mm_cache_dir


class WorkerRegistry:
    def __init__(self):
        self.workers: dict[str, WorkerInfo] = {}

    def on_ready(self, msg: Ready) -> WorkerInfo:
        info = WorkerInfo(msg.worker_id, msg.role, msg.inbox, host=msg.host, mm_cache_dir=msg.mm_cache_dir)
        self.workers[msg.worker_id] = info
        return info

    def on_stats(self, msg: WorkerStats) -> None:
        info = self.workers.get(msg.worker_id)
        if info is not None:
            info.stats = msg
            info.last_seen_s = time.monotonic()

    def by_role(self, *roles: str) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.role in roles]

    def is_alive(self, info: WorkerInfo) -> bool:
        return time.monotonic() - info.last_seen_s < STATS_STALE_S

    def all_alive(self) -> bool:
        return bool(self.workers) and all(self.is_alive(w) for w in self.workers.values())
