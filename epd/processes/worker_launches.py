"""`worker_launches`: the workers of a local deployment, one `WorkerLaunch` each
(spec, engine settings with its device and KV share, threads, niceness), for
`epd serve` (epd/processes/launcher.py) and `--api-servers N` (epd/processes/api_servers.py)."""
from __future__ import annotations

from dataclasses import replace

from epd.config import ServeConfig
from epd.processes.worker_entry import WorkerLaunch
from epd.transport.wire.addresses import Addresses, worker_id
from epd.transport.host.core_lease import CoreShare, create_lease_file, lease_path
from epd.transport.wire.worker_io import WorkerSpec

# A worker that got SIGTERM with the launcher serves on this long past --shutdown-grace for its
# Shutdown: the API's 503s written (2 s), the API stopped, the launcher's Shutdown sent.
SIGTERM_MARGIN_S = 30.0


def visible_gpus(device: str) -> int:
    """CUDA devices this process sees (CUDA_VISIBLE_DEVICES applies); 0 when told to use the CPU."""
    if device == "cpu":
        return 0
    import torch

    return torch.cuda.device_count()


def worker_launches(config: ServeConfig, addresses: Addresses, collectors: tuple[str, ...], mm_cache_dir: str
                    ) -> list[WorkerLaunch]:
    """`collectors`: every API process's collector address, by API index."""
    engines = config.worker_engines(visible_gpus(config.engine.device))
    roles = config.worker_roles()
    shares = _core_shares(config, addresses, [role.holds_kv and not engine.device.startswith("cuda")
                                              for (role, _), engine in zip(roles, engines)])
    launches = []
    num_kv_workers = 0  # the engine workers so far: each publishes its KV events on its own port
    for (role, index), engine, share in zip(roles, engines, shares):
        if role.holds_kv and engine.kv_events_config is not None:
            engine = replace(engine, kv_events_config=engine.kv_events_config.for_rank(num_kv_workers))
            num_kv_workers += 1
        spec = WorkerSpec(worker_id(role, index), role, addresses.worker(role, index), collectors,
                          mm_cache_dir, config.mm_cache_bytes, max_image_bytes=config.media.max_blob_bytes,
                          reports_kv_blocks=role.holds_kv and config.router == "cache_aware")
        if engine.device.startswith("cuda"):
            print(f"EPD: {spec.worker_id} on {engine.device}"
                  + (f", KV cache up to {engine.gpu_memory_utilization:.0%} of its memory"
                     if role.holds_kv else ""), flush=True)
        launches.append(WorkerLaunch(spec, config.model, engine, max_image_pixels=config.media.max_image_pixels,
                                     mm_processor_kwargs=config.files.mm_processor_kwargs,
                                     tokenizer=config.files.tokenizer, decode_limits=config.media.decode_limits(),
                                     num_threads=config.threads_for_each_worker(role), nice=config.worker_nice(role),
                                     core_share=share,
                                     sigterm_grace_s=config.limits.shutdown_grace_s + SIGTERM_MARGIN_S))
    return launches


def _core_shares(config: ServeConfig, addresses: Addresses, leases: list[bool]) -> list[CoreShare | None]:
    """Each worker's place in the run's core lease (transport/host/core_lease.py), by `leases` (a CPU
    engine worker); all None when fewer than two lease or the threads are fixed (`leased_cores`)."""
    num_cores = config.leased_cores()
    if num_cores is None or sum(leases) < 2 or addresses.scheme != "ipc":
        return [None] * len(leases)
    path = lease_path(addresses.run_dir)
    create_lease_file(path, sum(leases))
    slots = iter(range(sum(leases)))
    return [CoreShare(path, next(slots), num_cores) if leased else None for leased in leases]
