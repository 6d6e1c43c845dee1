"""One deployment builder for every front end of `epd serve`.

    Deployment.build(config)
      the run dir (0700: the ipc sockets' only protection); with --api-servers N
        its metrics dir, named in PROMETHEUS_MULTIPROC_DIR before prometheus_client loads
      the embedding cache dir, and the workers' CPU discipline (share_cores: inherited
        through the workers' forkserver, started after it)
      the worker plane, one of
        local      LocalSupervisor over worker_launches, the workers forked from a
                   forkserver that imported torch once; a collector per API process
                   on ipc in the run dir
        external   LocalSupervisor with no launches (each `epd worker` registers
                   itself); collectors on tcp from --worker-port up
        Ray        RaySupervisor (epd/processes/ray_cluster.py); one collector on tcp on
                   this node, the API's worker-plane keys
      -> Deployment(collectors, keys_dir, supervisor)   close(): workers stopped, run dir gone
    build_api(config, collector, ..., supervisor)  -> (Orchestrator, app): every API process
    http_server(config, app, drain, ...)           -> HttpServer: uvicorn with EPD's signals

The supervisor (the `Supervisor` of epd/processes/supervisor.py) is made once,
here, and given to whatever needs it at construction: the launcher drives
it; the orchestrator reads it as a `WorkerWatch` (which exits it sees at
once, the restart counts). With one API process (epd/processes/launcher.py) that
is the supervisor itself; with N (epd/processes/api_servers.py) the launcher
holds it and each API process reads a view of it (`LauncherWorkers`).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from epd.config import ServeConfig
from epd.families.registry import family_of
from epd.multiprocess_metrics import MULTIPROC_DIR_ENV  # read by prometheus_client when imported (not yet, here)
from epd.processes.local_supervisor import LocalSupervisor, worker_context
from epd.processes.supervisor import Supervisor, WorkerWatch
from epd.processes.threads import share_cores
from epd.processes.worker_launches import worker_launches
from epd.transport.wire.addresses import Addresses, tcp_address

UVICORN_STOP_S = 3  # uvicorn's own grace for open connections, once EPD's drain is done


@dataclass
class Deployment:
    """The parts every front end shares: where things live, the collectors, who keeps the workers up."""

    config: ServeConfig
    run_dir: str
    mm_cache_dir: str
    collectors: list[str]  # API process k's collector address, by index
    keys_dir: str | None  # the API's worker-plane keys (tcp collectors), else None
    supervisor: Supervisor

    @classmethod
    def build(cls, config: ServeConfig) -> Deployment:
        """Everything but the start: no worker runs until `supervisor.start()`."""
        run_dir = tempfile.mkdtemp(prefix="epd-")
        try:
            if config.api_servers > 1:  # each process's request metrics land here, summed by any /metrics
                os.makedirs(os.path.join(run_dir, "metrics"))
                os.environ[MULTIPROC_DIR_ENV] = os.path.join(run_dir, "metrics")
            mm_cache_dir = os.path.abspath(config.mm_cache_dir or os.path.join(run_dir, "mm-cache"))
            os.makedirs(mm_cache_dir, mode=0o700, exist_ok=True)
            share_cores(config.cpu_sharing)  # the workers' OpenMP wait (GOMP_SPINCOUNT), inherited through the forkserver
            collectors, keys_dir, supervisor = _worker_plane(config, run_dir, mm_cache_dir)
        except BaseException:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise
        return cls(config, run_dir, mm_cache_dir, collectors, keys_dir, supervisor)

    def close(self) -> None:
        """Every worker stopped (Shutdown first, then signals), the run dir removed."""
        try:
            self.supervisor.stop()
        finally:
            shutil.rmtree(self.run_dir, ignore_errors=True)


def api_collectors(config: ServeConfig, addresses: Addresses | None) -> list[str]:
    """Every API process's collector, by index: ipc in the run dir, or tcp from the worker port up."""
    if config.external_workers:
        first = config.worker_port or config.port + 1
        return [tcp_address(config.host, first + k) for k in range(config.api_servers)]
    return [addresses.collector(k) for k in range(config.api_servers)]


def _worker_plane(config: ServeConfig, run_dir: str, mm_cache_dir: str
                  ) -> tuple[list[str], str | None, Supervisor]:
    """(collectors, worker keys dir, supervisor): Ray actors, external workers, or local processes."""
    if config.ray is not None:  # every worker in a Ray actor: epd/processes/ray_cluster.py
        from epd.processes.ray_cluster import start_ray_plane

        plane = start_ray_plane(config, run_dir)
        return [plane.collector], plane.keys_dir, plane.supervisor
    addresses = None if config.external_workers else Addresses.ipc(run_dir)
    collectors = api_collectors(config, addresses)
    launches = [] if addresses is None else worker_launches(config, addresses, tuple(collectors), mm_cache_dir)
    limits = config.limits
    supervisor = LocalSupervisor(launches, worker_context(), max_restarts=limits.max_restarts,
                                 restart_window_s=limits.restart_window_s, down_retry_s=limits.down_retry_s,
                                 addresses=addresses)
    return collectors, config.worker_keys, supervisor


def build_api(config: ServeConfig, collector: str, mm_cache_dir: str, supervisor: WorkerWatch,
              keys_dir: str | None = None, api_index: int = 0, lifespan=None, lora_registry_path: str | None = None):
    """(Orchestrator, FastAPI app) of API process `api_index`, the supervisor given at construction;
    `lifespan(orchestrator)`: the app's lifespan (the workers started before the first request);
    `lora_registry_path`: the adapters' registry file the API processes share (None: its own)."""
    from epd.api.server import build_app
    from epd.processes.http_server import api_settings
    from epd.serve.orchestrator import Orchestrator

    orchestrator = Orchestrator(config, collector, mm_cache_dir, keys_dir=keys_dir, api_index=api_index,
                                supervisor=supervisor)
    settings = api_settings(config, orchestrator.files.sampling_defaults, lora_registry_path,
                            takes_audio=family_of(orchestrator.files.hf_config).audio is not None)
    app = build_app(orchestrator, settings, lifespan=None if lifespan is None else lifespan(orchestrator))
    return orchestrator, app


def http_server(config: ServeConfig, app, drain: Callable[[float], Awaitable[None]], **listen):
    """uvicorn with EPD's signals and HTTP protocol for `app`; `listen`: host and port, or a backlog
    for the sockets given to `run`."""
    import uvicorn

    from epd.api.fast_path import HttpServer, http_protocol

    return HttpServer(uvicorn.Config(app, log_level=config.uvicorn_log_level, timeout_graceful_shutdown=UVICORN_STOP_S,
                                     http=http_protocol(), **listen), drain, config.limits.shutdown_grace_s)
