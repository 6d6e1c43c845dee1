"""`LocalSupervisor`: the workers as child processes of the launcher
(multiprocessing forkserver, `worker_context`), kept up as every `Supervisor`
does (epd/processes/supervisor.py: the interface, the backoff, the down retry).

An exited worker is logged with its exit code and started again after the
backoff, or given up on and tried again every `down_retry_s`. The new
process binds the same inbox and registers with `Ready` again: the
orchestrator, told of the exit through `on_exit(worker_id, exit_code)`,
stops routing to it meanwhile and recovers its requests.
"""
from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import threading
import time
from dataclasses import replace

from epd.processes.supervisor import POLL_S, SHUTDOWN_GRACE_S, ExitCallback, Supervisor
from epd.processes.worker_entry import STOP_NOW, WorkerLaunch, run_worker
from epd.transport.wire.addresses import Addresses, parse_worker_id, worker_id as make_worker_id
from epd.transport.wire.roles import Role

# A removed worker is idle (drained first): it may take its time to exit on a busy machine
# (a niced encoder took 4 s on 2 shared cores) before SIGKILL.
REMOVE_GRACE_S = 30.0

# What every worker imports before it builds its model: ~6.5 CPU-seconds a process on this
# project's 2-core hosts (torch alone 3.4 s). The forkserver imports them once; each worker (and
# each restart) forks from it with them loaded, sharing their pages copy-on-write.
WORKER_PRELOAD = ("torch", "transformers", "transformers.models.auto.configuration_auto",
                  "epd.processes.worker_entry", "epd.engine.engine_core", "epd.engine.worker.loop", "epd.engine.model_info",
                  "epd.encoders.image_encoder", "epd.encoders.encoder_worker", "epd.encoders.video_encoder")


def worker_context():
    """The multiprocessing context local workers start from: a forkserver, started by the
    first worker from this process's environment at that moment (so the launcher sets the
    workers' environment, e.g. epd/processes/threads.share_cores, before it starts any), that has
    imported `WORKER_PRELOAD`. It imports nothing else, starts no thread and touches no GPU,
    so forking it is safe where forking the launcher (threads, sockets) is not."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(WORKER_PRELOAD))
    return context


class LocalSupervisor(Supervisor):
    def __init__(self, launches: list[WorkerLaunch], mp_context, max_restarts: int = 5,
                 restart_window_s: float = 60.0, addresses: Addresses | None = None,
                 down_retry_s: float = 30.0):
        """`addresses`: where an added worker's inbox goes (`add_worker` needs them)."""
        super().__init__(max_restarts, restart_window_s, down_retry_s)
        self.launches = {launch.spec.worker_id: launch for launch in launches}
        self.addresses = addresses
        self._templates: dict[Role, WorkerLaunch] = {}  # role -> the launch an added worker copies
        for launch in launches:
            self._templates.setdefault(launch.spec.role, launch)
        self._removing: dict[str, float] = {}  # worker id -> when remove_worker stopped it
        self.ctx = mp_context
        self.procs: dict[str, object] = {}  # worker id -> multiprocessing.Process

    def start(self) -> None:
        for worker_id in self.launches:
            self._spawn(worker_id)

    def _spawn(self, worker_id: str) -> None:
        launch = self.launches[worker_id]
        if self.ctx.get_start_method() == "forkserver":
            _forkserver_running()
        proc = self.ctx.Process(target=run_worker, args=(launch,), name=f"epd-{worker_id}", daemon=False)
        proc.start()
        self.procs[worker_id] = proc
        print(f"EPD: worker {worker_id} pid {proc.pid}", flush=True)  # operators (and the chaos test) read it

    def sees_exit(self, worker_id: str) -> bool:
        """Its own child processes: an exit is seen within POLL_S (a busy worker is not a dead one)."""
        return worker_id in self.launches

    def _holds(self, worker_id: str) -> bool:
        return worker_id in self.launches and worker_id not in self._removing

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
        # no place in the core lease: its slots are the launched engine workers' (fixed threads instead)
        self.launches[worker_id] = replace(template, spec=spec, core_share=None)
        self._spawn(worker_id)
        return worker_id

    def remove_worker(self, worker_id: str) -> None:
        """STOP_NOW (the worker closes its sockets and exits 0), SIGKILL after
        REMOVE_GRACE_S; `watch` reaps it and never restarts it."""
        if worker_id not in self.launches:
            raise KeyError(f"no worker {worker_id!r}")
        self._removing[worker_id] = time.monotonic()
        proc = self.procs.get(worker_id)
        if proc is not None and proc.exitcode is None:
            _stop_now(proc)

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
                proc.join(timeout=0)
                delay = self._exited(worker_id, proc.exitcode, f"exited with code {proc.exitcode}", on_exit)
                if delay is None:
                    continue
                print(f"EPD: worker {worker_id} exited with code {proc.exitcode}; restarting in {delay:g} s",
                      flush=True)
                restarting.add(worker_id)
                asyncio.get_running_loop().call_later(delay, self._restart, worker_id, restarting)
            await asyncio.sleep(POLL_S)

    def _start_again(self, worker_id: str) -> None:
        self._spawn(worker_id)

    def _restart(self, worker_id: str, restarting: set[str]) -> None:
        restarting.discard(worker_id)
        if self._stopping or not self._holds(worker_id):
            return
        self._count_restart(worker_id)
        self._spawn(worker_id)

    def stop(self) -> None:
        """Joins workers told to stop (Shutdown), then STOP_NOW, then SIGKILL."""
        self._stopping = True
        procs = [p for p in self.procs.values() if p.pid is not None]
        for p in procs:
            p.join(timeout=SHUTDOWN_GRACE_S)
        for p in procs:
            if p.is_alive():
                _stop_now(p)
                p.join(timeout=SHUTDOWN_GRACE_S)
            if p.is_alive():
                p.kill()
                p.join()


def _forkserver_running() -> None:
    """Starts the forkserver, if it is not running, with SIGTERM ignored (kept across its exec):
    a SIGTERM to the whole group must not end it, for the launcher reads its workers' exits
    through it (a dead forkserver reads as every worker exiting with code 255, restarted while
    the old ones serve on). It still exits with the launcher. Ignored here for that moment only,
    so from the main thread (elsewhere it is started as it is)."""
    if threading.current_thread() is not threading.main_thread():
        multiprocessing.forkserver.ensure_running()
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)  # None: not Python's


def _stop_now(proc) -> None:
    """The worker's STOP_NOW (epd/processes/worker_entry.py: SIGTERM only lets it serve on until Shutdown)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, STOP_NOW)
