"""`epd serve`: start every worker (under a supervisor that restarts the ones
that exit), wait for each one's Ready, serve HTTP; on Ctrl-C stop, on SIGTERM
drain first, and either way shut everything down with no process left behind.

`epd worker`: one worker of a multi-machine deployment, registering itself
with an API started with `--external-workers`.
"""
from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys

from epd.config import ServeConfig, WorkerConfig
from epd.processes.api_servers import serve_many
from epd.processes.deployment import Deployment, build_api, http_server
from epd.processes.heap import freeze_startup_heap
from epd.processes.supervisor import Supervisor
from epd.processes.worker_entry import WorkerLaunch, run_worker
from epd.transport.wire.addresses import tcp_address
from epd.transport.wire.worker_io import WorkerSpec


def serve(config: ServeConfig) -> int:
    """The deployment (epd/processes/deployment.py), served by one API process here or N behind one port."""
    deployment = Deployment.build(config)
    try:
        code = serve_many(deployment) if config.api_servers > 1 else _serve_one(deployment)
    finally:
        deployment.close()
    if code == 0:
        print("EPD: stopped; every worker exited", flush=True)
    return code


def _serve_one(deployment: Deployment) -> int:
    """This process is the API: it holds the supervisor, which starts the workers in the app's lifespan."""
    config, supervisor, collector = deployment.config, deployment.supervisor, deployment.collectors[0]
    orchestrator, app = build_api(config, collector, deployment.mm_cache_dir, supervisor,
                                  keys_dir=deployment.keys_dir,
                                  lifespan=lambda orchestrator: _lifespan(config, orchestrator, supervisor, collector))
    server = http_server(config, app, lambda grace_s: _drain(orchestrator, grace_s), host=config.host,
                         port=config.port)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    return 0 if server.started else 1


def _lifespan(config: ServeConfig, orchestrator, supervisor: Supervisor, collector: str):
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
        from epd.processes.encoder_pool import start_encoder_pool  # not at the top: it imports prometheus_client

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
    media = config.media()  # the image and video limits of `epd worker`'s flags, as `epd serve`'s
    spec = WorkerSpec(f"{config.role}@{socket.gethostname()}:{port}", config.role, tcp_address(config.host, port),
                      apis, config.mm_cache_dir, config.mm_cache_bytes, keys_dir=config.worker_keys,
                      max_image_bytes=media.max_blob_bytes,
                      reports_kv_blocks=config.role.holds_kv and config.report_kv_blocks)
    launch = WorkerLaunch(spec, config.model, config.engine, max_image_pixels=config.max_image_pixels,
                          num_threads=config.num_worker_threads(), tokenizer=config.tokenizer,
                          mm_processor_kwargs=config.mm_processor_kwargs, decode_limits=media.decode_limits())
    print(f"EPD worker {spec.worker_id}: inbox {spec.inbox} (CURVE), registering with {config.api}", flush=True)
    try:
        try:
            run_worker(launch, spawned=False)
        finally:
            # Stopped (Ctrl-C, or the API's Shutdown that `epd serve` sends as it stops): what is left
            # is the interpreter's exit, which gives a Python-handled SIGINT its default action back
            # (death: exit -2) before it tears torch down, seconds on a busy host. A Ctrl-C that finds
            # the worker stopping on its own must not turn its clean stop into -2; SIGTERM still ends it.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    except KeyboardInterrupt:
        pass
    return 0
