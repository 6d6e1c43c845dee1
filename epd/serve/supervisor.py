"""Keeping workers up. What a launcher of workers offers the orchestrator
(`RaySupervisor` in epd/serve/ray_cluster.py offers the same with Ray actors):

    start()                     start every worker
    all_alive()                 every worker process runs (start-up checks this)
    await watch(on_exit)        until cancelled: notice an exit within POLL_S, report
                                it (on_exit(worker_id, exit_code, restarting)),
                                restart the worker after a backoff
    add_worker(role) -> str     start one more worker of `role` (a new index, a new
                                inbox); returns its worker id; it registers with Ready
    remove_worker(worker_id)    stop that worker gracefully and never restart it; its
                                exit is not reported (the caller stopped routing to
                                it first: epd/serve/encoder_pool.py)
    stop()                      stop them all, no process left behind

`LocalSupervisor` runs workers as child processes (multiprocessing spawn).
An exited worker is logged with its exit code and started again after
0.5 s, doubling up to 8 s while it keeps dying; past `max_restarts` exits
within `restart_window_s` it is given up on (reported with restarting=False:
its role may be down, and requests needing it get a 503 at once) and tried
again every `down_retry_s` (`--down-retry-interval`). The
new process binds the same inbox and registers with `Ready` again: the
orchestrator, told of the exit through `on_exit(worker_id, exit_code)`,
stops routing to it meanwhile and recovers its requests.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from epd.serve.worker_entry import WorkerLaunch, run_worker
from epd.transport.addresses import Addresses, parse_worker_id, worker_id as make_worker_id
from epd.transport.roles import Role

log = logging.getLogger("epd.supervisor")

POLL_S = 0.1  # how often process exits are looked for
SHUTDOWN_GRACE_S = 5.0  # a worker told to stop gets this long before SIGTERM, then SIGKILL
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.5, 8.0
# A removed worker is idle (drained first): it may take its time to exit on a busy machine
# (a niced encoder took 4 s on 2 shared cores) before SIGKILL.
REMOVE_GRACE_S = 30.0

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


class LocalSupervisor:
    def __init__(self, launches: list[WorkerLaunch], mp_context, max_restarts: int = 5,
                 restart_window_s: float = 60.0, addresses: Addresses | None = None,
                 down_retry_s: float = 30.0):
        """`addresses`: where an added worker's inbox goes (`add_worker` needs them)."""
        self.launches = {launch.spec.worker_id: launch for launch in launches}
        self.addresses = addresses
        self._templates: dict[Role, WorkerLaunch] = {}  # role -> the launch an added worker copies
        for launch in launches:
            self._templates.setdefault(launch.spec.role, launch)
        self._removing: dict[str, float] = {}  # worker id -> when remove_worker stopped it
        self.ctx = mp_context
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.down_retry_s = down_retry_s
        self.procs: dict[str, object] = {}  # worker id -> multiprocessing.Process
        self.restarts: dict[str, int] = {}
        self.down: set[str] = set()
        self.budget = RestartBudget(max_restarts, restart_window_s)
        self._stopping = False

    def start(self) -> None:
        for worker_id in self.launches:
            self._spawn(worker_id)

    def _spawn(self, worker_id: str) -> None:
        launch = self.launches[worker_id]
        proc = self.ctx.Process(target=run_worker, args=(launch,), name=f"epd-{worker_id}", daemon=False)
        proc.start()
        self.procs[worker_id] = proc
        print(f"EPD: worker {worker_id} pid {proc.pid}", flush=True)  # operators (and the chaos test) read it

    def owns(self, worker_id: str) -> bool:
        """Whether `worker_id` is one of this supervisor's processes (its exit is reported, not guessed)."""
        return worker_id in self.launches

    def all_alive(self) -> bool:
        return all(p.is_alive() for p in self.procs.values())

    def add_worker(self, role: Role | str) -> str:
        """Starts one more worker of `role`, a copy of the first one launched, at the
        lowest index no running worker of the role holds; returns its worker id."""
        role = Role.parse(role)
        template = self._templates.get(role)
        if template is None or self.addresses is None:
            raise ValueError(f"this launcher started no {role} worker to add another like it")
        taken = {parse_worker_id(w)[1] for w in self.launches if parse_worker_id(w)[0] == role}
        index = next(i for i in range(len(taken) + 1) if i not in taken)
        worker_id = make_worker_id(role, index)
        spec = replace(template.spec, worker_id=worker_id, inbox=self.addresses.worker(role, index))
        self.launches[worker_id] = replace(template, spec=spec)
        self._spawn(worker_id)
        return worker_id

    def remove_worker(self, worker_id: str) -> None:
        """SIGTERM (the worker closes its sockets and exits 0), SIGKILL after
        REMOVE_GRACE_S; `watch` reaps it and never restarts it."""
        if worker_id not in self.launches:
            raise KeyError(f"no worker {worker_id!r}")
        self._removing[worker_id] = time.monotonic()
        proc = self.procs.get(worker_id)
        if proc is not None and proc.exitcode is None:
            proc.terminate()

    def _reap_removed(self) -> None:
        for worker_id, since in list(self._removing.items()):
            proc = self.procs.get(worker_id)
            if proc is not None and proc.exitcode is None:
                if time.monotonic() - since > REMOVE_GRACE_S:
                    proc.kill()
                continue
            if proc is not None:
                proc.join(timeout=0)
            for table in (self.procs, self.launches, self._removing):
                table.pop(worker_id, None)
            self.budget.forget(worker_id)
            self.down.discard(worker_id)
            print(f"EPD: worker {worker_id} removed"
                  + (f" (exit code {proc.exitcode})" if proc is not None else ""), flush=True)

    async def watch(self, on_exit: ExitCallback) -> None:
        restarting: set[str] = set()
        while True:
            self._reap_removed()
            for worker_id, proc in list(self.procs.items()):
                if worker_id in restarting or worker_id in self.down or worker_id in self._removing \
                        or proc.exitcode is None:
                    continue
                code = proc.exitcode
                proc.join(timeout=0)
                delay = self.budget.next_delay(worker_id)
                on_exit(worker_id, code, delay is not None)
                if delay is None:
                    self.down.add(worker_id)
                    print(f"EPD: worker {worker_id} exited with code {code}; it exited {self.max_restarts + 1} "
                          f"times within {self.restart_window_s:g} s: its role is down; trying it again in "
                          f"{self.down_retry_s:g} s", flush=True)
                    asyncio.get_running_loop().call_later(self.down_retry_s, self._retry_down, worker_id)
                    continue
                print(f"EPD: worker {worker_id} exited with code {code}; restarting in {delay:g} s", flush=True)
                restarting.add(worker_id)
                asyncio.get_running_loop().call_later(delay, self._restart, worker_id, restarting)
            await asyncio.sleep(POLL_S)

    def _retry_down(self, worker_id: str) -> None:
        """A worker given up on is tried again (every `down_retry_s`): a fault that
        passed (a full disk, a lost device) lets its role rejoin without a restart of serve."""
        if self._stopping or worker_id in self._removing or worker_id not in self.launches \
                or worker_id not in self.down:
            return
        self.down.discard(worker_id)
        print(f"EPD: worker {worker_id}: trying its role again", flush=True)
        self._restart(worker_id, set())

    def _restart(self, worker_id: str, restarting: set[str]) -> None:
        restarting.discard(worker_id)
        if self._stopping or worker_id in self._removing or worker_id not in self.launches:
            return
        role = str(self.launches[worker_id].spec.role)
        self.restarts[role] = self.restarts.get(role, 0) + 1
        self._spawn(worker_id)

    def stop(self) -> None:
        """Joins workers told to stop (Shutdown), then SIGTERM, then SIGKILL."""
        self._stopping = True
        procs = [p for p in self.procs.values() if p.pid is not None]
        for p in procs:
            p.join(timeout=SHUTDOWN_GRACE_S)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=SHUTDOWN_GRACE_S)
            if p.is_alive():
                p.kill()
                p.join()
