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
import signal
import socket
import sys
import tempfile
import threading
import time

import uvicorn

from epd.config import ServeConfig, WorkerConfig
from epd.serve.heap import freeze_startup_heap
from epd.serve.roles import WorkerLaunch, run_worker
from epd.serve.supervisor import LocalSupervisor
from epd.transport.addresses import Addresses, tcp_address, worker_id
from epd.transport.worker_io import WorkerSpec

DRAIN_POLL_S = 0.1


def visible_gpus(device: str) -> int:
    """CUDA devices this process sees (CUDA_VISIBLE_DEVICES applies); 0 when told to use the CPU."""
    if device == "cpu":
        return 0
    import torch

    return torch.cuda.device_count()


def worker_launches(config: ServeConfig, addresses: Addresses, collector: str, mm_cache_dir: str
                    ) -> list[WorkerLaunch]:
    engines = config.worker_engines(visible_gpus(config.engine.device))
    launches = []
    for (role, index), engine in zip(config.worker_roles(), engines):
        spec = WorkerSpec(worker_id(role, index), role, addresses.worker(role, index), collector,
                          mm_cache_dir, config.mm_cache_bytes)
        if engine.device.startswith("cuda"):
            print(f"EPD: {spec.worker_id} on {engine.device}"
                  + (f", KV cache up to {engine.gpu_memory_utilization:.0%} of its memory"
                     if role.holds_kv else ""), flush=True)
        launches.append(WorkerLaunch(spec, config.model, engine, max_image_pixels=config.media.max_image_pixels,
                                     num_threads=config.threads_for_each_worker(role), nice=config.worker_nice(role)))
    return launches


def serve(config: ServeConfig) -> int:
    if config.api_servers > 1:
        from epd.serve.api_servers import serve_many

        return serve_many(config)
    from epd.api.http_protocol import http_protocol
    from epd.api.server import ApiSettings, build_app
    from epd.serve.orchestrator import Orchestrator

    run_dir = tempfile.mkdtemp(prefix="epd-")  # 0700: the ipc sockets' only protection
    mm_cache_dir = os.path.abspath(config.mm_cache_dir or os.path.join(run_dir, "mm-cache"))
    os.makedirs(mm_cache_dir, exist_ok=True)
    keys_dir = config.worker_keys
    if config.cpu_sharing == "shared":
        # workers whose threads outnumber the cores must not spin while they wait
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if config.ray is not None:  # every worker in a Ray actor: epd/serve/ray_cluster.py
        from epd.serve.ray_cluster import start_ray_plane

        plane = start_ray_plane(config, run_dir)
        collector, keys_dir, supervisor = plane.collector, plane.keys_dir, plane.supervisor
    else:
        if config.external_workers:
            collector = tcp_address(config.host, config.worker_port or config.port + 1)
            addresses = None
        else:
            addresses = Addresses.ipc(run_dir)
            collector = addresses.collector()
        launches = [] if config.external_workers else worker_launches(config, addresses, collector, mm_cache_dir)
        supervisor = LocalSupervisor(launches, multiprocessing.get_context("spawn"),
                                     max_restarts=config.limits.max_restarts, down_retry_s=config.limits.down_retry_s,
                                     restart_window_s=config.limits.restart_window_s, addresses=addresses)

    orchestrator = Orchestrator(config, collector, mm_cache_dir, keys_dir=keys_dir)
    if config.ray is None:  # a busy local worker is not a dead one (Ray's workers may be on lost nodes)
        orchestrator.registry.supervised = supervisor.owns
    orchestrator.metrics.worker_restarts = lambda: dict(supervisor.restarts)
    app = build_app(orchestrator, ApiSettings(served_model_name=config.model_name, api_key=config.api_key,
                                                max_images_per_prompt=config.media.limit_images_per_prompt,
                                                max_request_body_bytes=config.limits.max_request_body_bytes,
                                                sampling_defaults=orchestrator.files.sampling_defaults))

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

    async def drain() -> None:
        """SIGTERM: refuse new requests (503 + Retry-After), let those in flight finish."""
        orchestrator.draining = True
        print(f"EPD: SIGTERM: draining {orchestrator.num_active} requests "
              f"(up to {config.limits.shutdown_grace_s:g} s)", flush=True)
        deadline = time.monotonic() + config.limits.shutdown_grace_s
        while orchestrator.num_active and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)

    app.router.lifespan_context = lifespan
    server = _Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                    timeout_graceful_shutdown=3, http=http_protocol()), drain)
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


class _Server(uvicorn.Server):
    """uvicorn with EPD's signals. Ctrl-C stops now (open connections get 3 s);
    SIGTERM first drains (`drain`), then stops the same way. Neither signal is
    raised again after the stop (uvicorn's own habit, which for SIGTERM killed
    the process before the launcher could clean up)."""

    def __init__(self, config: uvicorn.Config, drain):
        super().__init__(config)
        self._drain = drain
        self._draining: asyncio.Task | None = None

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        loop = asyncio.get_running_loop()
        originals = {sig: signal.signal(sig, lambda sig, _frame: loop.call_soon_threadsafe(self._on_signal, sig))
                     for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int) -> None:
        if sig == signal.SIGTERM and self.started and self._draining is None:
            self._draining = asyncio.get_running_loop().create_task(self._drain_then_exit())
        elif self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        finally:
            self.should_exit = True


def run_external_worker(config: WorkerConfig) -> int:
    """`epd worker`: bind an inbox on tcp://host:port and register with the API at `config.api`."""
    port = config.port
    if port == 0:
        with socket.socket() as s:  # pick a free port for the inbox
            s.bind((config.host, 0))
            port = s.getsockname()[1]
    spec = WorkerSpec(f"{config.role}@{socket.gethostname()}:{port}", config.role, tcp_address(config.host, port),
                      config.api, config.mm_cache_dir, config.mm_cache_bytes, keys_dir=config.worker_keys)
    launch = WorkerLaunch(spec, config.model, config.engine, max_image_pixels=config.max_image_pixels,
                          num_threads=config.num_threads or (os.cpu_count() or 1))
    print(f"EPD worker {spec.worker_id}: inbox {spec.inbox} (CURVE), registering with {spec.api}", flush=True)
    try:
        run_worker(launch, spawned=False)
    except KeyboardInterrupt:
        pass
    return 0
