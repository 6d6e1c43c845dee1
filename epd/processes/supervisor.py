"""What keeps the workers up: the one interface every worker plane offers.

`Supervisor` is declared here and implemented twice: `LocalSupervisor`
(epd/processes/local_supervisor.py, child processes) and `RaySupervisor`
(epd/processes/ray_cluster.py, Ray actors). The deployment builder
(epd/processes/deployment.py) makes one and hands it, at construction, to
whatever needs it: the launcher drives it, the orchestrator reads it.

    start()                     start every worker
    all_alive()                 every worker process runs (start-up checks this)
    await watch(on_exit)        until cancelled: notice an exit within POLL_S, report
                                it (on_exit(worker_id, exit_code, restarting)),
                                start the worker again after a backoff
    add_worker(role) -> str     start one more worker of `role`; returns its worker id;
                                it registers with Ready (epd/processes/encoder_pool.py)
    remove_worker(worker_id)    stop that worker for good; its exit is not reported
                                (the caller stopped routing to it first)
    stop()                      stop them all, nothing left behind
    sees_exit(worker_id)        whether this supervisor sees that worker's exit at once
                                (the registry never judges such a worker by silence)
    restart_counts()            role -> workers started again (epd:worker_restarts)
    down                        worker ids given up on: their role may be down

What an exit leads to is the same for every plane and written once, here
(`_exited`, `_retry_down`): restarted 0.5 s after its first exit, doubling
up to 8 s while it keeps exiting (`RestartBudget`); past `max_restarts`
exits within `restart_window_s` it is given up on (reported with
restarting=False: its role may be down, and requests needing it get a 503 at
once) and tried again every `down_retry_s` (`--down-retry-interval`), as
vLLM's registry probes a lost engine: a fault that passed (a full disk, a
lost device, a lost node) lets the role rejoin without a restart of serve.

An API process that holds no supervisor (one of `--api-servers N`: the
launcher holds it) reads a `WorkerWatch` instead: `sees_exit` and
`restart_counts` alone.
"""
from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from typing import Protocol

from epd.transport.wire.addresses import parse_worker_id
from epd.transport.wire.roles import Role

POLL_S = 0.1  # how often exits are looked for
SHUTDOWN_GRACE_S = 5.0  # a worker told to stop gets this long before it is killed
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.5, 8.0

ExitCallback = Callable[[str, "int | None", bool], None]  # (worker id, exit code, restarting)


class RestartBudget:
    """When to start again a process that exited: 0.5 s after its first exit,
    doubling to 8 s while it keeps exiting, and not at all once it exited more
    than `max_restarts` times within `window_s` (None: never give up)."""

    def __init__(self, max_restarts: int | None, window_s: float):
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._exits: dict[object, deque[float]] = {}  # process key -> its recent exit times

    def next_delay(self, key) -> float | None:
        """Records an exit of `key`; the backoff before restarting it, or None once its restarts are used up."""
        now = time.monotonic()
        exits = self._exits.setdefault(key, deque())
        exits.append(now)
        while exits and now - exits[0] > self.window_s:
            exits.popleft()
        if self.max_restarts is not None and len(exits) > self.max_restarts:
            return None
        return min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (len(exits) - 1))

    def forget(self, key) -> None:
        self._exits.pop(key, None)


class WorkerWatch(Protocol):
    """What an API process reads of whoever keeps its workers up."""

    def sees_exit(self, worker_id: str) -> bool:
        """Whether `worker_id`'s exit is reported at once (so silence never judges it)."""

    def restart_counts(self) -> dict[str, int] | None:
        """Role -> workers started again; None: another process exports them (shared metric files)."""


class Unsupervised:
    """A `WorkerWatch` for an orchestrator whose workers nobody here keeps up (tests, tools)."""

    def sees_exit(self, worker_id: str) -> bool:
        return False

    def restart_counts(self) -> dict[str, int] | None:
        return {}


class Supervisor(ABC):
    """The interface of the module docstring, and the exit handling both planes share."""

    def __init__(self, max_restarts: int = 5, restart_window_s: float = 60.0, down_retry_s: float = 30.0):
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.down_retry_s = down_retry_s
        self.budget = RestartBudget(max_restarts, restart_window_s)
        self.restarts: dict[str, int] = {}  # role -> workers started again
        self.down: set[str] = set()
        self._stopping = False

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def all_alive(self) -> bool: ...

    @abstractmethod
    async def watch(self, on_exit: ExitCallback) -> None: ...

    @abstractmethod
    def add_worker(self, role: Role | str) -> str: ...

    @abstractmethod
    def remove_worker(self, worker_id: str) -> None: ...

    @abstractmethod
    def stop(self) -> None: ...

    @abstractmethod
    def sees_exit(self, worker_id: str) -> bool: ...

    def restart_counts(self) -> dict[str, int] | None:
        return dict(self.restarts)

    # ------------------------------------------------ shared by every plane

    @abstractmethod
    def _holds(self, worker_id: str) -> bool:
        """Whether `worker_id` is still one of this supervisor's (not removed)."""

    @abstractmethod
    def _start_again(self, worker_id: str) -> None:
        """Starts given-up `worker_id` anew (a fresh process or actor, the same worker id)."""

    def _exited(self, worker_id: str, exit_code: int | None, why: str, on_exit: ExitCallback) -> float | None:
        """`worker_id` exited (`why`, for the log): reported through `on_exit`; the
        backoff before starting it again, or None: given up on, and tried again
        every `down_retry_s` (`_retry_down`)."""
        delay = self.budget.next_delay(worker_id)
        on_exit(worker_id, exit_code, delay is not None)
        if delay is None:
            self.down.add(worker_id)
            print(f"EPD: worker {worker_id} {why}; it exited {self.max_restarts + 1} times within "
                  f"{self.restart_window_s:g} s: its role is down; trying it again in {self.down_retry_s:g} s",
                  flush=True)
            asyncio.get_running_loop().call_later(self.down_retry_s, self._retry_down, worker_id)
        return delay

    def _retry_down(self, worker_id: str) -> None:
        if self._stopping or worker_id not in self.down:
            return
        self.down.discard(worker_id)
        if not self._holds(worker_id):  # removed meanwhile
            return
        print(f"EPD: worker {worker_id}: trying its role again", flush=True)
        self._count_restart(worker_id)
        self._start_again(worker_id)

    def _count_restart(self, worker_id: str) -> None:
        role = str(parse_worker_id(worker_id)[0])
        self.restarts[role] = self.restarts.get(role, 0) + 1
