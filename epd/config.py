"""The server's one composed, frozen configuration, built once by the CLI.

Values discovered at run time (KV blocks, EOS ids, worker addresses) live in
their own objects, never here.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field, replace

from epd.engine.config import ENGINE_ROLES, EngineConfig

MODES = ("aggregated", "e-pd", "e-p-d")
ROUTERS = ("round_robin", "least_loaded", "prefix_hash")


@dataclass(frozen=True)
class MediaConfig:
    """What requests may reference. http(s) image URLs are off unless
    `allowed_media_domains` names hosts (exact, lower-case host names or IP
    addresses; IPv6 without brackets)."""

    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] = ()
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 64_000_000
    media_fetch_timeout_s: float = 5.0
    limit_images_per_prompt: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_image_bytes", "max_image_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not self.media_fetch_timeout_s > 0:
            raise ValueError(f"--media-fetch-timeout must be positive, got {self.media_fetch_timeout_s}")
        if self.limit_images_per_prompt is not None and self.limit_images_per_prompt < 0:
            raise ValueError(f"--limit-mm-per-prompt image=N needs N >= 0, got {self.limit_images_per_prompt}")
        if any(not d or d != d.strip().lower() or "/" in d or d.count(":") == 1 for d in self.allowed_media_domains):
            raise ValueError("--allowed-media-domains takes lower-case host names separated by commas "
                             f"(no scheme, port or path), got {','.join(self.allowed_media_domains)!r}")
        if self.allowed_local_media_path is not None and not os.path.isdir(self.allowed_local_media_path):
            raise ValueError(f"--allowed-local-media-path {self.allowed_local_media_path} is not a directory")


CPU_SHARING = ("split", "shared")
# Niceness per role when workers share cores ("shared"). CFS weights fall
# ~1.25x per level: at 4 an encoder gets ~30% of a core a busy prefill wants.
SHARED_CPU_NICE = {"decode": 0, "pd": 0, "aggregated": 0, "prefill": 2, "encoder": 4}


@dataclass(frozen=True)
class ServeConfig:
    model: str
    mode: str = "e-p-d"
    num_encoders: int = 1
    num_prefill: int = 1
    num_decode: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    mm_cache_dir: str | None = None  # None: a fresh directory under the run dir
    mm_cache_gb: float = 4.0
    router: str = "least_loaded"
    served_model_name: str | None = None
    api_key: str | None = None
    external_workers: bool = False
    worker_port: int | None = None  # collector port for external workers (default: port + 1)
    threads_per_worker: int | None = None  # None: decided by cpu_sharing
    cpu_sharing: str = "shared"  # or "split"; see threads_for_each_worker
    ready_timeout_s: float = 600.0
    engine: EngineConfig = field(default_factory=EngineConfig)
    media: MediaConfig = field(default_factory=MediaConfig)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.cpu_sharing not in CPU_SHARING:
            raise ValueError(f"--cpu-sharing must be one of {', '.join(CPU_SHARING)}, got {self.cpu_sharing!r}")
        if self.router not in ROUTERS:
            raise ValueError(f"--router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        for name in ("num_encoders", "num_prefill", "num_decode"):
            if getattr(self, name) < 0 or (getattr(self, name) == 0 and not self.external_workers):
                raise ValueError(f"--{name.split('_')[1]} must be at least 1, got {getattr(self, name)}")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if self.mm_cache_gb <= 0:
            raise ValueError(f"--mm-cache-gb must be positive, got {self.mm_cache_gb}")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"{self.model} is not a checkpoint directory (no config.json)")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def mm_cache_bytes(self) -> int:
        return int(self.mm_cache_gb * (1 << 30))

    def worker_roles(self) -> list[tuple[str, int]]:
        """(role, index) of every worker the launcher starts for this mode."""
        if self.external_workers:
            return []
        if self.mode == "aggregated":
            return [("aggregated", i) for i in range(self.num_prefill)]
        encoders = [("encoder", i) for i in range(self.num_encoders)]
        if self.mode == "e-pd":
            return encoders + [("pd", i) for i in range(self.num_prefill)]
        return encoders + [("prefill", i) for i in range(self.num_prefill)] + \
            [("decode", i) for i in range(self.num_decode)]

    def threads_for_each_worker(self) -> int:
        """"split": the cores this process may run on, divided over the
        workers. "shared": every worker may use all of them and the kernel
        shares them out by priority (`worker_nice`), so an idle stage's cores
        go to a busy one."""
        if self.threads_per_worker:
            return self.threads_per_worker
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if self.cpu_sharing == "shared":
            return cores
        return max(1, cores // max(1, len(self.worker_roles())))

    def worker_nice(self, role: str) -> int:
        """The niceness a worker of `role` runs at: 0 unless the cores are
        shared, then later stages first (a decode step, then a prefill, then
        an encode), so work already under way finishes before new work starts."""
        return SHARED_CPU_NICE.get(role, 0) if self.cpu_sharing == "shared" else 0

    def worker_engines(self, num_gpus: int) -> list[EngineConfig]:
        """The engine settings of each worker, in `worker_roles()` order.

        On CPU (or `--device auto` with no GPU visible) every worker gets
        `self.engine`. On GPUs the workers go round robin over the visible
        ones, KV-cache workers first, so that two GPUs put a prefill and a
        decode worker apart and a third takes the encoder; `cuda:N` pins every
        worker to GPU N. The KV-cache workers that share a GPU split
        `gpu_memory_utilization` evenly (as in vLLM, the share of each GPU's
        memory the server may take); encoders hold no KV cache and use what
        their forward pass needs."""
        roles = [role for role, _ in self.worker_roles()]
        device = self.engine.device
        if device == "cpu" or (device == "auto" and num_gpus == 0):
            return [self.engine] * len(roles)
        gpus = [device] if device.startswith("cuda:") else [f"cuda:{i}" for i in range(max(1, num_gpus))]
        order = sorted(range(len(roles)), key=lambda i: roles[i] not in ENGINE_ROLES)  # stable
        placed = {worker: gpus[slot % len(gpus)] for slot, worker in enumerate(order)}
        kv_workers = Counter(placed[i] for i, role in enumerate(roles) if role in ENGINE_ROLES)
        engines = []
        for i, role in enumerate(roles):
            share = kv_workers[placed[i]] if role in ENGINE_ROLES else 1
            engines.append(replace(self.engine, device=placed[i],
                                   gpu_memory_utilization=self.engine.gpu_memory_utilization / share))
        return engines
