"""`epd serve`: start every worker (under a supervisor that restarts the ones
that exit), wait for each one's Ready, serve HTTP; on Ctrl-C stop, on SIGTERM
drain first, and either way shut everything down with no process left behind.

`epd worker`: one worker of a multi-machine deployment, registering itself
with an API started with `--external-workers`.
"""
from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import shutil
import socket
import sys
import tempfile

import uvicorn

from epd.config import ServeConfig, WorkerConfig
from epd.serve.heap import freeze_startup_heap
from epd.serve.http_server import api_settings
from epd.serve.worker_entry import WorkerLaunch, run_worker
from epd.serve.supervisor import LocalSupervisor
from epd.serve.threads import share_cores
from epd.serve.worker_launches import worker_launches
from epd.transport.addresses import Addresses, tcp_address
from epd.transport.worker_io import WorkerSpec


def serve(config: ServeConfig) -> int:
    if config.api_servers > 1:
        from epd.serve.api_servers import serve_many

        return serve_many(config)
    from epd.api.fast_path import HttpServer, http_protocol
    from epd.api.server import build_app
    from epd.serve.orchestrator import Orchestrator

    run_dir = tempfile.mkdtemp(prefix="epd-")  # 0700: the ipc sockets' only protection
    mm_cache_dir = os.path.abspath(config.mm_cache_dir or os.path.join(run_dir, "mm-cache"))
    os.makedirs(mm_cache_dir, mode=0o700, exist_ok=True)
    share_cores(config.cpu_sharing)  # the workers' OMP_WAIT_POLICY, inherited through spawn
    collector, keys_dir, supervisor = _worker_plane(config, run_dir, mm_cache_dir)
    orchestrator = Orchestrator(config, collector, mm_cache_dir, keys_dir=keys_dir)
    if config.ray is None:  # a busy local worker is not a dead one (Ray's workers may be on lost nodes)
        orchestrator.registry.supervised = supervisor.owns
    orchestrator.metrics.worker_restarts = lambda: dict(supervisor.restarts)
    app = build_app(orchestrator, api_settings(config, orchestrator.files.sampling_defaults),
                    lifespan=_lifespan(config, orchestrator, supervisor, collector))
    server = HttpServer(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.uvicorn_log_level,
                                       timeout_graceful_shutdown=3, http=http_protocol()),
                        lambda grace_s: _drain(orchestrator, grace_s), config.limits.shutdown_grace_s)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        supervisor.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    if server.started:
        print("EPD: stopped; every worker exited", flush=True)
    return 0 if server.started else 1


def _worker_plane(config: ServeConfig, run_dir: str, mm_cache_dir: str):
    """(collector address, worker keys dir, supervisor) of the workers: Ray actors,
    external workers that register themselves, or local processes."""
    keys_dir = config.worker_keys
    if config.ray is not None:  # every worker in a Ray actor: epd/serve/ray_cluster.py
        from epd.serve.ray_cluster import start_ray_plane

        plane = start_ray_plane(config, run_dir)
        return plane.collector, plane.keys_dir, plane.supervisor
    if config.external_workers:
        collector = tcp_address(config.host, config.worker_port or config.port + 1)
        addresses = None
    else:
        addresses = Addresses.ipc(run_dir)
        collector = addresses.collector()
    launches = [] if config.external_workers else worker_launches(config, addresses, (collector,), mm_cache_dir)
    supervisor = LocalSupervisor(launches, multiprocessing.get_context("spawn"),
                                 max_restarts=config.limits.max_restarts, down_retry_s=config.limits.down_retry_s,
                                 restart_window_s=config.limits.restart_window_s, addresses=addresses)
    return collector, keys_dir, supervisor


def _lifespan(config: ServeConfig, orchestrator, supervisor, collector: str):
    """The app's lifespan: workers started and Ready before the first request, stopped after the last."""

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await orchestrator.start()
        supervisor.start()
        try:
            n = len(config.mode_roles())  # Ready messages to wait for, external workers included
            if config.external_workers or config.ray is not None:
                print(f"EPD: waiting for {n} {'Ray' if config.ray else 'external'} workers to register at {collector}", flush=True)
            await orchestrator.wait_for_workers(n, config.ready_timeout_s, alive=supervisor.all_alive)
        except Exception as exc:
            print(f"EPD: start-up failed: {exc}", file=sys.stderr, flush=True)
            await orchestrator.stop()
            supervisor.stop()
            raise
        watch = asyncio.create_task(supervisor.watch(orchestrator.on_worker_exit))
        from epd.serve.encoder_pool import start_encoder_pool  # not at the top: it imports prometheus_client

        scaling = start_encoder_pool(config, supervisor, orchestrator)  # --encoders MIN-MAX, else None
        roles = ", ".join(sorted(f"{w.worker_id}" for w in orchestrator.registry.workers.values()))
        freeze_startup_heap()  # tokenizer, app, orchestrator: out of every later full collection
        print(f"EPD ready ({config.mode}: {roles}); serving {config.model_name!r} on "
              f"http://{config.host}:{config.port}/v1", flush=True)
        try:
            yield
        finally:
            watch.cancel()
            if scaling is not None:
                scaling.cancel()
            await orchestrator.stop()
            supervisor.stop()

    return lifespan


async def _drain(orchestrator, grace_s: float) -> None:
    """SIGTERM (`grace_s`: --shutdown-grace) or Ctrl-C (0): Orchestrator.drain, said on the console."""
    print(f"EPD: stopping: {orchestrator.num_active} requests in flight"
          + (f" may finish for up to {grace_s:g} s" if grace_s else "") + "; new ones get 503", flush=True)
    await orchestrator.drain(grace_s)


def run_external_worker(config: WorkerConfig) -> int:
    """`epd worker`: bind an inbox on tcp://host:port and register with the API at `config.api`.
    The CLI called `share_cores` before torch was imported; the threads are `epd serve`'s
    rule for a host with this one worker. No niceness: it orders `epd serve`'s own stages on
    one host, and an external worker's neighbours are unknown (another job's, which a niced
    worker would yield to)."""
    port = config.port
    if port == 0:
        with socket.socket() as s:  # pick a free port for the inbox
            s.bind((config.host, 0))
            port = s.getsockname()[1]
    apis = tuple(config.api.split(","))  # --api: one collector per API process, joined by ","
    spec = WorkerSpec(f"{config.role}@{socket.gethostname()}:{port}", config.role, tcp_address(config.host, port),
                      apis, config.mm_cache_dir, config.mm_cache_bytes, keys_dir=config.worker_keys,
                      max_image_bytes=config.max_image_bytes)
    launch = WorkerLaunch(spec, config.model, config.engine, max_image_pixels=config.max_image_pixels,
                          num_threads=config.num_worker_threads())
    print(f"EPD worker {spec.worker_id}: inbox {spec.inbox} (CURVE), registering with {config.api}", flush=True)
    try:
        run_worker(launch, spawned=False)
    except KeyboardInterrupt:
        pass
    return 0
