"""`epd serve --api-servers N` (N > 1): N API processes behind one HTTP port,
all routing to the same workers.

    launcher (serve_many over the Deployment of epd/processes/deployment.py; serves no HTTP itself)
      binds the HTTP socket once; every API process accepts on it (as uvicorn
        --workers and gunicorn do: portable, and a dying process loses only the
        connections it had accepted, not the ones queued)
      the deployment's LocalSupervisor: the workers, whose WorkerSpec.apis names all N collectors
      ApiServers: starts API process k (run_api_server), restarts it when it exits
      a worker exits -> WorkerExited to every collector (the workers are not the
        API processes' children, so only the launcher sees them exit)
      an API process exits -> Abort(api_index=k) to every worker: its clients are gone
      PROMETHEUS_MULTIPROC_DIR=<run dir>/metrics: each process's request metrics
        land in files there and any process's /metrics renders their sum; worker
        restarts are counted here, into the same files
      stop: Ctrl-C or SIGTERM to every API process (SIGTERM: each drains), then
        Shutdown to the workers
    API process k (run_api_server)
      build_api(collector <run dir>/api[-k].sock, api_index=k, LauncherWorkers): its own
        registry (every worker registers with every API process), its own requests; it
        holds no supervisor, so it reads the launcher's through `LauncherWorkers`
      FastAPI app on the shared socket and on its own unix socket <run dir>/http-k.sock
        (to reach one process on purpose: operators, tests)
      the adapters served by name in <run dir>/loras.json, shared (epd/shared_lora_registry.py):
        a runtime LoRA load or unload through any process is seen by every process
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import multiprocessing
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass

from epd.config import ServeConfig
from epd.processes.deployment import Deployment, build_api, http_server
from epd.processes.heap import freeze_startup_heap
from epd.processes.local_supervisor import LocalSupervisor
from epd.processes.supervisor import POLL_S, RestartBudget
from epd.shared_lora_registry import REGISTRY_FILE
from epd.transport.wire.channels import Outbox, Sender
from epd.transport.wire.messages import Abort, Shutdown, WorkerExited

API_STOP_S = 10.0  # an API process told to stop gets this long (after draining) before SIGKILL
HTTP_BACKLOG = 2048


@dataclass(frozen=True)
class ApiServerLaunch:
    """What API process `index` needs; the HTTP socket travels with it (spawn passes its fd)."""

    config: ServeConfig
    index: int
    collector: str
    mm_cache_dir: str
    own_socket_path: str  # this process alone listens here (unix socket)
    lora_registry_path: str  # the adapters served by name, shared by every API process (runtime loads too)


class LauncherWorkers:
    """What an API process reads of the launcher's LocalSupervisor (a `WorkerWatch`,
    epd/processes/supervisor.py): the launcher's workers' exits arrive at once, as
    WorkerExited (external workers are nobody's children: silence judges them);
    restarts are counted by the launcher, into the shared metric files."""

    def __init__(self, external_workers: bool):
        self.external_workers = external_workers

    def sees_exit(self, worker_id: str) -> bool:
        return not self.external_workers

    def restart_counts(self) -> dict[str, int] | None:
        return None


def serve_many(deployment: Deployment) -> int:
    """The launcher: N API processes on one HTTP socket, the deployment's workers; stops on SIGINT / SIGTERM."""
    config = deployment.config
    try:
        http = socket.create_server((config.host, config.port), backlog=HTTP_BACKLOG)
    except OSError as exc:
        print(f"epd serve: cannot listen on {config.host}:{config.port}: {exc}", file=sys.stderr, flush=True)
        return 1
    registry = os.path.join(deployment.run_dir, REGISTRY_FILE)
    launches = [ApiServerLaunch(config, k, deployment.collectors[k], deployment.mm_cache_dir,
                                os.path.join(deployment.run_dir, f"http-{k}.sock"), registry)
                for k in range(config.api_servers)]
    servers = ApiServers(launches, http, multiprocessing.get_context("spawn"))
    try:
        return asyncio.run(_run(config, deployment.supervisor, servers, deployment.collectors))
    finally:
        servers.stop()
        http.close()


async def _run(config: ServeConfig, workers: LocalSupervisor, servers: ApiServers, apis: list[str]) -> int:
    from prometheus_client import Counter

    from epd.serve.worker_metrics import WORKER_RESTARTS

    loop = asyncio.get_running_loop()
    stop: asyncio.Future[int] = loop.create_future()  # the signal that stops us
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda sig=sig: stop.done() or stop.set_result(sig))
    workers.start()
    servers.start()
    deadline = time.monotonic() + config.ready_timeout_s
    while not servers.all_ready():
        failed = ("a worker process exited during start-up (see its log above)" if not workers.all_alive() else
                  "an API process exited during start-up (see its log above)" if servers.any_exited() else
                  f"not ready after {config.ready_timeout_s:.0f} s" if time.monotonic() > deadline else None)
        if failed or stop.done():
            if failed:
                print(f"EPD: start-up failed: {failed}", file=sys.stderr, flush=True)
            servers.signal_all(signal.SIGINT)
            return 1 if failed else 0
        await asyncio.sleep(0.05)
    print(f"EPD ready ({config.mode}, {config.api_servers} API processes); serving {config.model_name!r} on "
          f"http://{config.host}:{config.port}/v1", flush=True)

    restarts = Counter(*WORKER_RESTARTS, ["role"])  # in the shared metric files: every API process shows it
    counted: dict[str, int] = {}
    outbox = Outbox()  # ipc to the collectors (workers on other hosts are nobody's children here)

    def on_worker_exit(worker_id: str, exit_code: int | None, restarting: bool) -> None:
        for api in apis:
            outbox.send(api, WorkerExited(worker_id, exit_code, restarting))

    def on_api_exit(index: int) -> None:  # its clients are gone: the workers drop its requests
        for launch in workers.launches.values():
            outbox.send(launch.spec.inbox, Abort([], api_index=index))

    watches = [asyncio.create_task(workers.watch(on_worker_exit)), asyncio.create_task(servers.watch(on_api_exit))]
    try:
        while not stop.done():
            for role, n in workers.restart_counts().items():
                restarts.labels(role).inc(n - counted.get(role, 0))
                counted[role] = n
            await asyncio.wait([stop], timeout=POLL_S)
    finally:
        for watch in watches:
            watch.cancel()
    sig = stop.result()
    if sig == signal.SIGTERM:
        print(f"EPD: SIGTERM: every API process drains (up to {config.limits.shutdown_grace_s:g} s)", flush=True)
    servers.signal_all(sig)
    await asyncio.to_thread(servers.join, config.limits.shutdown_grace_s + API_STOP_S)
    outbox.close()
    for launch in workers.launches.values():  # the API processes stopped: now the workers
        with Sender(launch.spec.inbox) as sender:
            sender.send(Shutdown())
            sender.close(linger_s=1.0)  # a restarted worker still loading connects late
    return 0


class ApiServers:
    """Starts the API processes and keeps them up: an exited one is started
    again after 0.5 s, doubling to 8 s while it keeps exiting (the workers and
    the other API processes serve on meanwhile)."""

    def __init__(self, launches: list[ApiServerLaunch], http: socket.socket, mp_context):
        self.launches = launches
        self.http = http
        self.ctx = mp_context
        self.procs: dict[int, object] = {}  # index -> multiprocessing.Process
        self.ready: dict[int, object] = {}  # index -> multiprocessing.Event, set once it serves
        self.restarts = 0
        # an API process is restarted however often it exits (the server has no other way in); the
        # backoff still grows while it keeps exiting and starts again once it has stayed up a minute
        self._budget = RestartBudget(max_restarts=None, window_s=60.0)
        self._stopping = False

    def start(self) -> None:
        for launch in self.launches:
            self._spawn(launch.index)

    def _spawn(self, index: int) -> None:
        ready = self.ctx.Event()
        proc = self.ctx.Process(target=run_api_server, args=(self.launches[index], self.http, ready),
                                name=f"epd-api-{index}", daemon=False)
        proc.start()
        self.procs[index], self.ready[index] = proc, ready
        print(f"EPD: API server {index} pid {proc.pid}", flush=True)

    def all_ready(self) -> bool:
        return all(event.is_set() for event in self.ready.values())

    def any_exited(self) -> bool:
        return any(p.exitcode is not None for p in self.procs.values())

    async def watch(self, on_exit) -> None:
        """Until cancelled: an exited API process is reported (`on_exit(index)`) and started again."""
        restarting: set[int] = set()
        while True:
            for index, proc in list(self.procs.items()):
                if index in restarting or proc.exitcode is None:
                    continue
                proc.join(timeout=0)
                on_exit(index)
                delay = self._budget.next_delay(index)
                print(f"EPD: API server {index} exited with code {proc.exitcode}; restarting in {delay:g} s",
                      flush=True)
                restarting.add(index)
                asyncio.get_running_loop().call_later(delay, self._restart, index, restarting)
            await asyncio.sleep(POLL_S)

    def _restart(self, index: int, restarting: set[int]) -> None:
        restarting.discard(index)
        if not self._stopping:
            self.restarts += 1
            self._spawn(index)

    def signal_all(self, sig: int) -> None:
        self._stopping = True
        for proc in self.procs.values():
            if proc.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, sig)

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            proc.join(timeout=max(0.0, deadline - time.monotonic()))

    def stop(self) -> None:
        """No API process left behind: SIGKILL whatever still runs."""
        self._stopping = True
        for proc in self.procs.values():
            if proc.exitcode is None:
                proc.kill()
                proc.join()


# ------------------------------------------------------------ one API process

def run_api_server(launch: ApiServerLaunch, http: socket.socket, ready) -> None:
    """Process entry of API process `launch.index`: serve HTTP on `http` (shared)
    and on its own unix socket until told to stop (SIGINT: now; SIGTERM: drain first)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    config = launch.config

    @contextlib.asynccontextmanager
    async def lifespan(_app):  # `orchestrator` is build_api's, below (the lifespan runs once the server starts)
        await orchestrator.start()
        try:
            # every worker registers with every API process (a restarted one hears them re-announce)
            await orchestrator.wait_for_workers(len(config.mode_roles()), config.ready_timeout_s)
        except Exception as exc:
            print(f"EPD: API server {launch.index}: start-up failed: {exc}", file=sys.stderr, flush=True)
            await orchestrator.stop(shutdown_workers=False)
            raise
        freeze_startup_heap()  # tokenizer, app, orchestrator: out of every later full collection
        ready.set()
        print(f"EPD: API server {launch.index} pid {os.getpid()} ready; its own socket unix:"
              f"{launch.own_socket_path}", flush=True)
        try:
            yield
        finally:
            await orchestrator.stop(shutdown_workers=False)  # the workers serve the other API processes

    orchestrator, app = build_api(config, launch.collector, launch.mm_cache_dir,
                                  LauncherWorkers(config.external_workers), api_index=launch.index,
                                  lifespan=lambda _orchestrator: lifespan, lora_registry_path=launch.lora_registry_path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(launch.own_socket_path)  # left by the process this one replaces
    own = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    own.bind(launch.own_socket_path)
    server = http_server(config, app, orchestrator.drain, backlog=HTTP_BACKLOG)
    try:
        server.run(sockets=[http, own])
    except KeyboardInterrupt:
        pass
    finally:
        own.close()
