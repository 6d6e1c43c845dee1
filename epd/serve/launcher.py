"""`epd serve`: start every worker, wait for each one's Ready, serve HTTP,
and on Ctrl-C / SIGTERM shut everything down with no process left behind.

`epd worker`: one worker of a multi-machine deployment, registering itself
with an API started with `--external-workers`.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import socket
import sys
import tempfile
from epd.config import ServeConfig, WorkerConfig
from epd.serve.roles import WorkerLaunch, run_worker
from epd.transport.addresses import Addresses, tcp_address, worker_id
from epd.transport.worker_io import WorkerSpec

SHUTDOWN_GRACE_S = 5.0


def visible_gpus(device: str) -> int:
    """CUDA devices this process sees (CUDA_VISIBLE_DEVICES applies); 0 when told to use the CPU."""
    if device == "cpu":
        return 0
    import torch

    return torch.cuda.device_count()


def _stop_processes(procs: list) -> None:
    for p in procs:
        p.join(timeout=SHUTDOWN_GRACE_S)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=SHUTDOWN_GRACE_S)
        if p.is_alive():
            p.kill()
            p.join()


def serve(config: ServeConfig) -> int:
    import uvicorn

    from epd.api.server import ApiSettings, build_app
    from epd.serve.orchestrator import Orchestrator

    run_dir = tempfile.mkdtemp(prefix="epd-")
    mm_cache_dir = os.path.abspath(config.mm_cache_dir or os.path.join(run_dir, "mm-cache"))
    os.makedirs(mm_cache_dir, exist_ok=True)
    if config.external_workers:
        collector = tcp_address(config.host, config.worker_port or config.port + 1)
        addresses = None
    else:
        addresses = Addresses.ipc(run_dir)
        collector = addresses.collector()
    ctx = multiprocessing.get_context("spawn")
    if config.cpu_sharing == "shared":
        # workers whose threads outnumber the cores must not spin while they wait
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    threads = config.threads_for_each_worker()
    engines = config.worker_engines(visible_gpus(config.engine.device))
    procs = []
    for (role, index), engine in zip(config.worker_roles(), engines):
        spec = WorkerSpec(worker_id(role, index), role, addresses.worker(role, index), collector,
                          mm_cache_dir, config.mm_cache_bytes)
        if engine.device.startswith("cuda"):
            print(f"EPD: {spec.worker_id} on {engine.device}"
                  + (f", KV cache up to {engine.gpu_memory_utilization:.0%} of its memory"
                     if role.holds_kv else ""), flush=True)
        launch = WorkerLaunch(spec, config.model, engine, max_image_pixels=config.media.max_image_pixels,
                              num_threads=threads, nice=config.worker_nice(role))
        procs.append(ctx.Process(target=run_worker, args=(launch,), name=f"epd-{spec.worker_id}", daemon=False))

    orchestrator = Orchestrator(config, collector, mm_cache_dir)
    app = build_app(orchestrator, ApiSettings(served_model_name=config.model_name, api_key=config.api_key,
                                                max_images_per_prompt=config.media.limit_images_per_prompt))

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await orchestrator.start()
        for p in procs:
            p.start()
        try:
            n = len(config.mode_roles())  # Ready messages to wait for, external workers included
            if config.external_workers:
                print(f"EPD: waiting for {n} external workers to register at {collector}", flush=True)
            await orchestrator.wait_for_workers(n, config.ready_timeout_s, alive=lambda: all(p.is_alive() for p in procs))
        except Exception as exc:
            print(f"EPD: start-up failed: {exc}", file=sys.stderr, flush=True)
            await orchestrator.stop()
            _stop_processes(procs)
            raise
        roles = ", ".join(sorted(f"{w.worker_id}" for w in orchestrator.registry.workers.values()))
        print(f"EPD ready ({config.mode}: {roles}); serving {config.model_name!r} on "
              f"http://{config.host}:{config.port}/v1", flush=True)
        try:
            yield
        finally:
            await orchestrator.stop()
            _stop_processes(procs)

    app.router.lifespan_context = lifespan
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                           timeout_graceful_shutdown=3))
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    finally:
        _stop_processes([p for p in procs if p.pid is not None])
        shutil.rmtree(run_dir, ignore_errors=True)
    if server.started:
        print("EPD: stopped; every worker exited", flush=True)
    return 0 if server.started else 1


def run_external_worker(config: WorkerConfig) -> int:
    """`epd worker`: bind an inbox on tcp://host:port and register with the API at `config.api`."""
    port = config.port
    if port == 0:
        with socket.socket() as s:  # pick a free port for the inbox
            s.bind((config.host, 0))
            port = s.getsockname()[1]
    spec = WorkerSpec(f"{config.role}@{socket.gethostname()}:{port}", config.role, tcp_address(config.host, port),
                      config.api, config.mm_cache_dir, config.mm_cache_bytes)
    launch = WorkerLaunch(spec, config.model, config.engine, max_image_pixels=config.max_image_pixels,
                          num_threads=config.num_threads or (os.cpu_count() or 1))
    print(f"EPD worker {spec.worker_id}: inbox {spec.inbox}, registering with {spec.api}", flush=True)
    try:
        run_worker(launch, spawned=False)
    except KeyboardInterrupt:
        pass
    return 0
