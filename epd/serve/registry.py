"""The API process's view of its workers: addresses, roles, latest load, life.

Workers announce themselves with `Ready` (spawned by the launcher, or
started elsewhere with `epd worker`, which is how external workers register)
and publish `WorkerStats` a few times a second. A worker is dead when its
supervisor saw its process exit (`mark_dead`) or, if no supervisor here
watches it (`epd worker` on another host), when it has been silent for
`HEARTBEAT_TIMEOUT_S`; a `Ready` (a restarted process) brings it back. A
worker the launcher supervises (its processes, or Ray's actors) is never
judged by silence: it sends nothing during a step or an encoder batch, which
on a busy CPU can take longer than any timeout, and its exit is reported
within 0.1 s anyway. A
worker being removed on purpose is `retire`d (never chosen again), then
forgotten.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from epd.transport.messages import Ready, WorkerStats

# Silent this long (no WorkerStats, sent every 0.25 s) counts as dead, for workers no
# supervisor here watches. Generous: a worker sends nothing during one step, and a
# long prefill step on a busy CPU takes seconds.
HEARTBEAT_TIMEOUT_S = 10.0


@dataclass
class WorkerInfo:
    worker_id: str
    role: str
    inbox: str
    host: str = ""
    mm_cache_dir: str | None = None
    stats: WorkerStats | None = None
    last_seen_s: float = field(default_factory=time.monotonic)
    is_dead: bool = False  # its process exited (told by the supervisor)
    is_retired: bool = False  # being removed (autoscaling): no new work, never live again

    @property
    def load(self) -> int:
        """Requests on or queued for this worker, from its latest stats."""
        s = self.stats
        return 0 if s is None else s.num_running + s.num_waiting + s.queue_depth

    def shares_cache_with(self, other: WorkerInfo) -> bool:
        return bool(self.mm_cache_dir) and self.host == other.host and self.mm_cache_dir == other.mm_cache_dir


class WorkerRegistry:
    def __init__(self, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
                 supervised: Callable[[str], bool] = lambda worker_id: False):
        """`supervised(worker_id)`: a supervisor here reports that worker's exit
        (the launcher sets it), so its silence means busy, not dead."""
        self.workers: dict[str, WorkerInfo] = {}
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.supervised = supervised

    def on_ready(self, msg: Ready) -> WorkerInfo:
        """A worker (re)started: alive from now, whatever came before (but a
        retired one stays retired). A live worker's `Ready` again (it
        re-announces while there are several API processes) only refreshes it."""
        known = self.workers.get(msg.worker_id)
        if known is not None and known.inbox == msg.inbox and self.is_alive(known):
            known.last_seen_s = time.monotonic()
            return known
        info = WorkerInfo(msg.worker_id, msg.role, msg.inbox, host=msg.host, mm_cache_dir=msg.mm_cache_dir,
                          is_retired=known is not None and known.is_retired)
        self.workers[msg.worker_id] = info
        return info

    def retire(self, worker_id: str) -> None:
        """The router stops choosing `worker_id`; it keeps reporting until `forget`."""
        info = self.workers.get(worker_id)
        if info is not None:
            info.is_retired = True

    def forget(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)

    def on_stats(self, msg: WorkerStats) -> None:
        info = self.workers.get(msg.worker_id)
        if info is not None and not info.is_dead:
            info.stats = msg
            info.last_seen_s = time.monotonic()

    def mark_dead(self, worker_id: str) -> WorkerInfo | None:
        info = self.workers.get(worker_id)
        if info is not None:
            info.is_dead = True
        return info

    def by_role(self, *roles: str) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.role in roles]

    def live(self, *roles: str) -> list[WorkerInfo]:
        """The workers of `roles` the router may choose: never a dead one."""
        return [w for w in self.by_role(*roles) if self.is_alive(w)]

    def is_alive(self, info: WorkerInfo) -> bool:
        return not info.is_dead and not info.is_retired and (
            self.supervised(info.worker_id) or time.monotonic() - info.last_seen_s < self.heartbeat_timeout_s)

    def missing_roles(self, required: Iterable[str]) -> list[str]:
        """The roles in `required` without a live worker, in order."""
        return [str(role) for role in dict.fromkeys(required) if not self.live(role)]
