"""The API process's view of its workers: addresses, roles, latest load, life.

Workers announce themselves with `Ready` (spawned by the launcher, or
started elsewhere with `epd worker`, which is how external workers register)
and publish `WorkerStats` a few times a second from their loop; while the
loop is busy (a long ViT batch or prefill step) their heartbeat thread sends
`Alive` instead (transport/wire/worker_io.py). A worker is dead when its
supervisor saw its process exit (`mark_dead`) or, if no supervisor here
watches it (`epd worker` on another host, a Ray actor), when it has sent
neither for the heartbeat timeout (`HEARTBEAT_TIMEOUT_S`, or
`EPD_HEARTBEAT_TIMEOUT_S`), or when its loop has been busy past
`stuck_after_s` (the request timeout: nothing it holds can still finish in
time); its stats or a `Ready` bring it back. A worker the launcher's own
processes run is never judged by silence: its exit is reported within 0.1 s,
with whether the supervisor restarts it; a role with no live worker and none
being restarted is down (`down_roles`): requests needing it are refused at once.

Who may speak for a worker id: the process whose `Ready` registered it (its
`session`, a secret drawn at its start). Stats and Alive under another session
are ignored, and a `Ready` under another session is refused while the
registered worker is alive (docs/architecture.md, "The worker plane's authority").
A worker being removed on purpose is `retire`d (never chosen again), then
forgotten.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from epd.transport.wire.messages import Alive, Ready, WorkerStats

# Silent this long (no WorkerStats, sent every 0.25 s, nor Alive, every 0.5 s while the loop
# is busy) counts as dead, for workers no supervisor here watches.
HEARTBEAT_TIMEOUT_S = 10.0
HEARTBEAT_TIMEOUT_ENV = "EPD_HEARTBEAT_TIMEOUT_S"  # overrides it (slow links; short in tests)


def heartbeat_timeout_s_env() -> float:
    value = os.environ.get(HEARTBEAT_TIMEOUT_ENV)
    try:
        timeout_s = float(value) if value else HEARTBEAT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{HEARTBEAT_TIMEOUT_ENV}={value!r}: expected seconds") from None
    if timeout_s <= 0:
        raise ValueError(f"{HEARTBEAT_TIMEOUT_ENV}={value!r}: expected seconds > 0")
    return timeout_s


@dataclass
class WorkerInfo:
    worker_id: str
    role: str
    inbox: str
    host: str = ""
    mm_cache_dir: str | None = None
    stats: WorkerStats | None = None
    last_seen_s: float = field(default_factory=time.monotonic)
    busy_s: float = 0.0  # how long its loop had not come back, at its last Alive (0 after stats)
    is_dead: bool = False  # its process exited (told by the supervisor)
    is_down: bool = False  # ... and the supervisor gave up restarting it (for now: it probes again later)
    is_retired: bool = False  # being removed (autoscaling): no new work, never live again
    session: str = ""  # the session token of its Ready: only that process may speak for this worker id
    working_on: tuple[str, ...] = ()  # an encoder's batch in progress (request ids), from its Alive

    @property
    def load(self) -> int:
        """Requests on or queued for this worker, from its latest stats."""
        s = self.stats
        return 0 if s is None else s.num_running + s.num_waiting + s.queue_depth

    def has_adapter(self, lora_name: str) -> bool:
        """Whether its latest stats show the adapter resident in a slot (the routers' preference)."""
        s = self.stats
        return s is not None and s.lora is not None and lora_name in s.lora.resident

    def shares_cache_with(self, other: WorkerInfo) -> bool:
        return bool(self.mm_cache_dir) and self.host == other.host and self.mm_cache_dir == other.mm_cache_dir


class WorkerRegistry:
    def __init__(self, heartbeat_timeout_s: float | None = None,
                 supervised: Callable[[str], bool] = lambda worker_id: False,
                 stuck_after_s: float = float("inf")):
        """`supervised(worker_id)`: a supervisor here sees that worker's exit at once
        (`Supervisor.sees_exit`), so it is never judged by silence.
        `heartbeat_timeout_s`: None reads EPD_HEARTBEAT_TIMEOUT_S (default 10 s).
        `stuck_after_s`: an unsupervised worker whose loop has been busy this long is dead."""
        self.workers: dict[str, WorkerInfo] = {}
        if heartbeat_timeout_s is None:
            heartbeat_timeout_s = heartbeat_timeout_s_env()
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.supervised = supervised
        self.stuck_after_s = stuck_after_s

    def on_ready(self, msg: Ready) -> WorkerInfo | None:
        """A worker (re)started: alive from now, whatever came before (but a
        retired one stays retired). A live worker's `Ready` again (every worker
        re-announces each second) only refreshes it. None: refused, a live
        worker holds that id under another session (a takeover: only the
        process itself, or its successor once it is dead, may register it)."""
        known = self.workers.get(msg.worker_id)
        if known is not None and self.is_alive(known):
            if known.session != msg.session:
                return None
            if known.inbox == msg.inbox:
                known.last_seen_s = time.monotonic()
                return known
        info = WorkerInfo(msg.worker_id, msg.role, msg.inbox, host=msg.host, mm_cache_dir=msg.mm_cache_dir,
                          is_retired=known is not None and known.is_retired, session=msg.session)
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
        if info is not None and not info.is_dead and msg.session == info.session:
            info.stats = msg
            info.last_seen_s = time.monotonic()
            info.busy_s = 0.0
            info.working_on = ()  # the loop is between batches

    def on_alive(self, msg: Alive) -> WorkerInfo | None:
        """Its loop is busy but its process is up: not silent (its stats stay the last ones).
        An encoder's loop says with it which requests its batch holds (`working_on`)."""
        info = self.workers.get(msg.worker_id)
        if info is None or info.is_dead or msg.session != info.session:
            return None
        info.last_seen_s = time.monotonic()
        info.busy_s = msg.busy_s
        if msg.working_on is not None:
            info.working_on = tuple(msg.working_on)
        return info

    def mark_dead(self, worker_id: str, restarting: bool = True) -> WorkerInfo | None:
        """Its process exited; `restarting`: the supervisor starts it again soon (else it is down)."""
        info = self.workers.get(worker_id)
        if info is not None:
            info.is_dead = True
            info.is_down = not restarting
        return info

    def by_role(self, *roles: str) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.role in roles]

    def live(self, *roles: str) -> list[WorkerInfo]:
        """The workers of `roles` the router may choose: never a dead one."""
        return [w for w in self.by_role(*roles) if self.is_alive(w)]

    def is_alive(self, info: WorkerInfo) -> bool:
        if info.is_dead or info.is_retired:
            return False
        return self.supervised(info.worker_id) or not (self.is_silent(info) or self.is_stuck(info))

    def is_silent(self, info: WorkerInfo) -> bool:
        return time.monotonic() - info.last_seen_s >= self.heartbeat_timeout_s

    def is_stuck(self, info: WorkerInfo) -> bool:
        """Up, but its loop has not come back for longer than any request may take."""
        return info.busy_s > self.stuck_after_s

    def reports(self, info: WorkerInfo) -> bool:
        """Whether its latest stats still describe a process (/metrics shows only those)."""
        return not info.is_dead and (self.supervised(info.worker_id) or not self.is_silent(info))

    def down_roles(self, required: Iterable[str]) -> list[str]:
        """The roles in `required` with no live worker and none coming back soon (none that the
        supervisor is restarting): a request needing one is refused at once, not kept waiting."""
        return [str(role) for role in dict.fromkeys(required) if not self.live(role)
                and not any(w.is_dead and not w.is_down for w in self.by_role(role))]

    def missing_roles(self, required: Iterable[str]) -> list[str]:
        """The roles in `required` without a live worker, in order."""
        return [str(role) for role in dict.fromkeys(required) if not self.live(role)]
