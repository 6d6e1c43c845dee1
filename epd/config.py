"""The one composed, frozen configuration of each command, built once by the CLI.

    ServeConfig (epd serve)          mode, worker counts, HTTP, routing, cores
      encoder_scaling                epd/processes/autoscale.py (--encoders MIN-MAX)
      engine: EngineConfig           epd/engine/config.py
        scheduler: SchedulerConfig   epd/engine/scheduler_config.py
      media: MediaConfig             epd/inputs/media.py
      files: ModelFilesConfig        epd/inputs/model_files.py (--chat-template, --generation-config)
    WorkerConfig (epd worker)        one worker registering with a remote API
      engine: EngineConfig

Every default is written once, on its field; the CLI's flag defaults are read
from these classes (`field_default`). Values discovered at run time (KV
blocks, EOS ids, worker addresses) live in their own objects, never here.
"""
from __future__ import annotations

import dataclasses
import os
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from epd.engine.config import EngineConfig
from epd.families.registry import check_family
from epd.lora_modules import LoRAModule
from epd.inputs.media import MediaConfig
from epd.inputs.model_files import ModelFilesConfig
from epd.processes.autoscale import EncoderScaling
from epd.processes.ray_config import RayConfig
from epd.serve.encoder_router import ENCODER_ROUTERS
from epd.serve.router import ROUTERS
from epd.processes.threads import CPU_SHARING, available_cores, lease_cores, serve_api_cores, worker_threads
from epd.transport.wire.addresses import MAX_API_SERVERS, is_tcp_address
from epd.transport.wire.auth import API, WORKER, PlaneKeyError, PlaneKeys
from epd.transport.wire.roles import Mode, Role

# vLLM's --tool-call-parser names EPD reads: epd/api/tool_parsers/'s TOOL_PARSERS (a test holds them equal;
# named here because the orchestrator, which reads this module, imports nothing of the HTTP edge)
TOOL_CALL_PARSERS = ("hermes", "pythonic", "glm45", "qwen3_coder")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
MAX_LOGPROBS = 20  # the wire's bound on logprobs a token (transport/wire/sampling.py)
# Niceness per role when workers share cores ("shared"). CFS weights fall
# ~1.25x per level: at 4 an encoder gets ~30% of a core a busy prefill wants.
SHARED_CPU_NICE = {Role.DECODE: 0, Role.PD: 0, Role.AGGREGATED: 0, Role.PREFILL: 2, Role.ENCODER: 4}
DEFAULT_MM_CACHE_GB = 4.0  # the embedding cache of `epd serve` and of `epd worker`
MAX_ENCODERS = 64  # encoder inboxes one deployment's addresses have room for (Addresses.max_workers_per_role)


def field_default(cls, name: str) -> Any:
    """The default of dataclass `cls`'s field `name` (a CLI flag's default)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _check_checkpoint(model: str) -> None:
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"{model} is not a checkpoint directory (no config.json)")


def _tool_parser_hint(model: str) -> str:
    """The --tool-call-parser the checkpoint's family names, else the list of them."""
    try:
        family = check_family(model)
    except (OSError, ValueError):  # not a checkpoint, or a family EPD does not serve: said later
        family = None
    if family is not None and family.tool_call_parser is not None:
        return f"--tool-call-parser {family.tool_call_parser} for {family.name}"
    return f"--tool-call-parser one of {', '.join(TOOL_CALL_PARSERS)}"


FLAGS = {"down_retry_s": "down-retry-interval"}  # ServingLimits fields whose flag is not their name


@dataclass(frozen=True)
class ServingLimits:
    """Deadlines and bounds of serving: no request waits forever, no queue
    grows without bound, a worker that keeps dying stops being restarted."""

    request_timeout_s: float = 600.0  # a request not finished by then gets an error (503)
    shutdown_grace_s: float = 30.0  # SIGTERM: requests in flight may finish this long
    max_pending_requests: int = 1024  # sequences in the API at once; beyond: 503 + Retry-After
    max_pending_image_bytes: int = 1 << 30  # raw image bytes of requests not yet prefilled; beyond: 503
    max_request_body_bytes: int = 64 << 20  # one HTTP body; beyond: 413 before it is read (epd/api/body_limit.py)
    max_restarts: int = 5  # restarts of one worker within restart_window_s; then its role is down
    restart_window_s: float = 60.0
    down_retry_s: float = 30.0  # a worker given up on (its role down) is started again this often
    # a request among the suspects of this many worker deaths is failed, not sent again (a poison request)
    max_request_worker_deaths: int = 2

    def __post_init__(self) -> None:
        for name in ("request_timeout_s", "shutdown_grace_s", "max_pending_requests", "max_pending_image_bytes",
                     "max_request_body_bytes", "restart_window_s", "down_retry_s"):
            if not getattr(self, name) > 0:
                flag = FLAGS.get(name) or name.removesuffix("_s").replace("_bytes", "_mb").replace("_", "-")
                raise ValueError(f"--{flag} must be positive, "
                                 f"got {getattr(self, name)}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be non-negative, got {self.max_restarts}")
        if self.max_request_worker_deaths < 1:
            raise ValueError(f"--max-request-worker-deaths must be at least 1, got {self.max_request_worker_deaths}")


@dataclass(frozen=True)
class ServeConfig:
    model: str
    mode: Mode = Mode.E_P_D  # a mode's name is accepted too
    num_encoders: int = 1
    num_prefill: int = 1  # prefill, pd or aggregated workers, by mode
    num_decode: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    mm_cache_dir: str | None = None  # None: a fresh directory under the run dir
    mm_cache_gb: float = DEFAULT_MM_CACHE_GB
    router: str = "least_loaded"  # one of ROUTERS
    encoder_router: str = "cost"  # one of ENCODER_ROUTERS
    served_model_name: str | None = None
    api_key: str | None = None
    metrics_require_key: bool = False  # /metrics behind --api-key too
    external_workers: bool = False
    worker_port: int | None = None  # collector port for external workers (default: port + 1)
    threads_per_worker: int | None = None  # None: decided by cpu_sharing
    cpu_sharing: str = "shared"  # or "split"; see threads_for_each_worker
    core_lease: bool = True  # --core-lease: idle CPU engine workers lend their cores (leased_cores)
    ready_timeout_s: float = 600.0
    worker_keys: str | None = None  # `epd keys` directory: CURVE on the worker port (needed with external workers)
    ray: RayConfig | None = None  # --cluster ray: workers in Ray actors (epd/processes/ray_cluster.py); None: local
    api_servers: int = 1  # API processes behind the one HTTP port (epd/processes/api_servers.py)
    stream_interval: int = 1  # a stream's tokens leave the worker every N tokens (first and last at once)
    # vLLM's front-end flags: what each does here is in its help and docs/usage.md
    max_logprobs: int = MAX_LOGPROBS  # logprobs / top_logprobs a request may ask; more is a 400
    trust_remote_code: bool = False  # accepted: EPD never runs a checkpoint's code
    enable_auto_tool_choice: bool = False  # accepted: tool_choice "auto" is always served
    tool_call_parser: str | None = None  # None (hermes) or one of TOOL_CALL_PARSERS: tool_choice "auto"'s format
    enable_chunked_prefill: bool | None = None  # always on: True is logged, False refused (None: not given)
    enable_log_requests: bool = False  # one log line per request (id, prompt, sampling)
    disable_log_stats: bool = False  # accepted: EPD logs no periodic stats (/metrics has them)
    uvicorn_log_level: str = "warning"  # one of UVICORN_LOG_LEVELS
    allowed_origins: tuple[str, ...] = ()  # CORS; () adds no CORS middleware (browsers refuse cross-origin)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    engine: EngineConfig = field(default_factory=EngineConfig)
    # --prefill-tensor-parallel-size / --decode-tensor-parallel-size (e-p-d): those workers' own
    # engine.tensor_parallel_size (None: the engine's); the KV hand-over joins groups of any sizes
    prefill_tensor_parallel_size: int | None = None
    decode_tensor_parallel_size: int | None = None
    lora_modules: tuple[LoRAModule, ...] = ()  # --lora-modules: the adapters served by name (with --enable-lora)
    allow_runtime_lora_updating: bool = False  # --allow-runtime-lora-updating: POST /v1/(un)load_lora_adapter
    media: MediaConfig = field(default_factory=MediaConfig)
    files: ModelFilesConfig = field(default_factory=ModelFilesConfig)  # what is read from the checkpoint
    limits: ServingLimits = field(default_factory=ServingLimits)
    encoder_scaling: EncoderScaling | None = None  # --encoders MIN-MAX (num_encoders = MIN); None: fixed

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode.parse(self.mode))
        _check_scaling(self)
        if self.cpu_sharing not in CPU_SHARING:
            raise ValueError(f"--cpu-sharing must be one of {', '.join(CPU_SHARING)}, got {self.cpu_sharing!r}")
        if self.router not in ROUTERS:
            raise ValueError(f"--router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if self.encoder_router not in ENCODER_ROUTERS:
            raise ValueError(f"--encoder-router must be one of {', '.join(ENCODER_ROUTERS)}, "
                             f"got {self.encoder_router!r}")
        for name in ("num_encoders", "num_prefill", "num_decode"):
            if getattr(self, name) < 0 or (getattr(self, name) == 0 and not self.external_workers):
                raise ValueError(f"--{name.split('_')[1]} must be at least 1, got {getattr(self, name)}")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if self.mm_cache_gb <= 0:
            raise ValueError(f"--mm-cache-gb must be positive, got {self.mm_cache_gb}")
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be at least 1, got {self.stream_interval}")
        if not 1 <= self.api_servers <= MAX_API_SERVERS:
            raise ValueError(f"--api-servers must be in 1..{MAX_API_SERVERS}, got {self.api_servers}")
        if not (self.max_logprobs == -1 or 0 <= self.max_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"--max-logprobs must be in 0..{MAX_LOGPROBS} (EPD returns at most {MAX_LOGPROBS} "
                             f"a token) or -1 (no cap below that), got {self.max_logprobs}")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(f"--tool-call-parser {self.tool_call_parser}: EPD reads tool calls with the parsers "
                             f"{', '.join(TOOL_CALL_PARSERS)} (vLLM's names)")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(f"--enable-auto-tool-choice requires --tool-call-parser (as in vLLM): "
                             f"{_tool_parser_hint(self.model)}")
        if self.enable_chunked_prefill is False:
            raise ValueError("--no-enable-chunked-prefill: EPD always prefills in chunks "
                             "(--max-num-batched-tokens a step)")
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise ValueError(f"--uvicorn-log-level must be one of {', '.join(UVICORN_LOG_LEVELS)}, "
                             f"got {self.uvicorn_log_level!r}")
        if self.api_servers > 1 and self.ray is not None:
            raise ValueError("--api-servers N > 1 runs with the local launcher or --external-workers, not --cluster ray")
        if self.api_servers > 1 and self.encoder_scaling is not None:
            raise ValueError("--api-servers N > 1 and --encoders MIN-MAX do not go together yet: "
                             "give --encoders a fixed count")
        if self.external_workers:
            _check_keys(self.worker_keys, API, "--external-workers")
        if self.ray is not None and self.external_workers:
            raise ValueError("--cluster ray starts the workers itself: drop --external-workers")
        for flag in ("prefill_tensor_parallel_size", "decode_tensor_parallel_size"):
            size = getattr(self, flag)
            if size is not None and size < 1:
                raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {size}")
        largest = max(self.engine.tensor_parallel_size, self.prefill_tensor_parallel_size or 1,
                      self.decode_tensor_parallel_size or 1)
        if largest > 1 and self.ray is not None:
            raise ValueError(f"--tensor-parallel-size {largest} with --cluster ray is not "
                             "served yet (a group's ranks would need one node's placement group)")
        if self.ray is not None and self.worker_keys:
            _check_keys(self.worker_keys, API, "--cluster ray")
        _check_checkpoint(self.model)
        if self.lora_modules and not self.engine.lora.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if self.allow_runtime_lora_updating and not self.engine.lora.enable_lora:
            raise ValueError("--allow-runtime-lora-updating needs --enable-lora")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def metrics_model_name(self) -> str:
        """The model_name label of /metrics: the served name, or the checkpoint directory's
        own name (never the path it lies at)."""
        return self.served_model_name or os.path.basename(os.path.normpath(self.model))

    @property
    def mm_cache_bytes(self) -> int:
        return int(self.mm_cache_gb * (1 << 30))

    def mode_roles(self) -> list[tuple[Role, int]]:
        """(role, index) of every worker this mode runs, wherever it is started."""
        return self.mode.roles(self.num_encoders, self.num_prefill, self.num_decode)

    def worker_roles(self) -> list[tuple[Role, int]]:
        """(role, index) of every worker the launcher starts (none with external workers)."""
        return [] if self.external_workers else self.mode_roles()

    def threads_for_each_worker(self, role: Role | str | None = None) -> int:
        """Torch threads of a worker of `role` (None: of an engine worker):
        `--threads-per-worker`, else the rule of epd/processes/threads.py, which
        leaves a core to the API process (not on a host of 2 cores or fewer)
        and, "split", divides the rest over the workers, "shared", over the
        engine workers (an encoder may use them all; the kernel shares cores
        by priority, `worker_nice`)."""
        if self.threads_per_worker:
            return self.threads_per_worker
        roles = [r for r, _ in self.worker_roles()]
        cores = available_cores()
        return worker_threads(None if role is None else Role.parse(role), roles, cores, self.cpu_sharing,
                              serve_api_cores(cores))

    def leased_cores(self) -> int | None:
        """The cores the launcher's CPU engine workers lend each other while idle (epd/processes/threads.py,
        `lease_cores`); None with `--no-core-lease`, with `--threads-per-worker`, "split", or a single
        engine worker."""
        if not self.core_lease or self.threads_per_worker:
            return None
        cores = available_cores()
        return lease_cores([r for r, _ in self.worker_roles()], cores, self.cpu_sharing, serve_api_cores(cores))

    def worker_nice(self, role: Role | str) -> int:
        """The niceness a worker of `role` runs at: 0 unless the cores are
        shared, then later stages first (a decode step, then a prefill, then
        an encode), so work already under way finishes before new work starts."""
        return SHARED_CPU_NICE[Role.parse(role)] if self.cpu_sharing == "shared" else 0

    def _cpu_engine(self) -> EngineConfig:
        """`self.engine` for workers on this host's CPUs: early prefill off by default where
        cores are shared, since an encoder then runs on every core the prefill worker would
        use: a prefill started early only took turns with the encoder's forward (a 4-image
        request on 2 cores: the forward 1.65 -> 1.9-2.1 s, TTFT 2.61-2.70 -> 2.71-2.86 s;
        docs/benchmarks_archive.md). `--early-prefill` turns it on."""
        if self.engine.early_prefill is None and self.cpu_sharing == "shared" and self.mode is not Mode.AGGREGATED:
            return replace(self.engine, early_prefill=False)
        return self.engine

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
            return [self._role_engine(role, self._cpu_engine()) for role in roles]
        gpus = [device] if device.startswith("cuda:") else [f"cuda:{i}" for i in range(max(1, num_gpus))]
        order = sorted(range(len(roles)), key=lambda i: not roles[i].holds_kv)  # stable
        placed = {worker: gpus[slot % len(gpus)] for slot, worker in enumerate(order)}
        kv_workers = Counter(placed[i] for i, role in enumerate(roles) if role.holds_kv)
        engines = []
        for i, role in enumerate(roles):
            share = kv_workers[placed[i]] if role.holds_kv else 1
            engines.append(replace(self._role_engine(role, self.engine), device=placed[i],
                                   gpu_memory_utilization=self.engine.gpu_memory_utilization / share))
        return engines

    def _role_engine(self, role: Role, engine: EngineConfig) -> EngineConfig:
        """`engine` with the role's own --tensor-parallel-size, where one is given."""
        size = {Role.PREFILL: self.prefill_tensor_parallel_size,
                Role.DECODE: self.decode_tensor_parallel_size}.get(role)
        return engine if size is None else replace(engine, tensor_parallel_size=size)


@dataclass(frozen=True)
class WorkerConfig:
    """`epd worker`: one worker on this host, registering with the API at `api`."""

    model: str
    role: Role  # a role's name is accepted too
    api: str  # tcp://HOST:PORT, the API's worker port; with --api-servers N, the N ports joined by ","
    host: str = "127.0.0.1"  # address this worker's inbox binds on
    port: int = 0  # inbox port; 0: any free port
    mm_cache_dir: str | None = None  # None: no embedding cache on this worker
    mm_cache_gb: float = DEFAULT_MM_CACHE_GB
    max_image_pixels: int = field_default(MediaConfig, "max_image_pixels")
    max_image_bytes: int = field_default(MediaConfig, "max_image_bytes")  # as the API's --max-image-bytes
    # as the API's video flags: the largest video its inbox takes, what decoding one may cost an encoder
    max_video_bytes: int = field_default(MediaConfig, "max_video_bytes")
    max_video_frames: int = field_default(MediaConfig, "max_video_frames")  # checked by the API (header)
    max_request_video_pixels: int = field_default(MediaConfig, "max_request_video_pixels")
    video_decode_timeout_s: float = field_default(MediaConfig, "video_decode_timeout_s")
    num_threads: int | None = None  # --threads-per-worker; None: `num_worker_threads`'s rule
    cpu_sharing: str = "shared"  # as `epd serve`'s; "shared" also sets OMP_WAIT_POLICY=PASSIVE here
    worker_keys: str | None = None  # `epd keys` directory (the worker's secret and both public keys)
    engine: EngineConfig = field(default_factory=EngineConfig)
    # as the API's `epd serve --tokenizer / --mm-processor-kwargs`: the worker must count and encode alike
    tokenizer: str | None = None
    mm_processor_kwargs: tuple[tuple[str, Any], ...] = ()
    report_kv_blocks: bool = False  # an engine worker's prefix-cache changes to the API (its --router cache_aware)

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role.parse(self.role))
        if self.engine.tensor_parallel_size > 1 and self.role is Role.ENCODER:
            raise ValueError(f"--tensor-parallel-size {self.engine.tensor_parallel_size}: an encoder worker is not "
                             "sharded (encoders scale by count); engine roles are")
        if self.cpu_sharing not in CPU_SHARING:
            raise ValueError(f"--cpu-sharing must be one of {', '.join(CPU_SHARING)}, got {self.cpu_sharing!r}")
        if not all(is_tcp_address(api) for api in self.api.split(",")):
            raise ValueError(f"--api must be a tcp:// address (the API's worker port), or one per API process "
                             f"joined by ',', got {self.api!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if self.mm_cache_gb <= 0:
            raise ValueError(f"--mm-cache-gb must be positive, got {self.mm_cache_gb}")
        _check_checkpoint(self.model)
        if self.tokenizer is not None and not os.path.isdir(self.tokenizer):
            raise ValueError(f"--tokenizer {self.tokenizer}: not a directory")
        _check_keys(self.worker_keys, WORKER, "epd worker")
        self.media()  # a bad image or video limit: MediaConfig's message, naming the flag

    def media(self) -> MediaConfig:
        """The media limits this worker applies: its inbox's largest item, an encoder's decode limits."""
        return MediaConfig(max_image_bytes=self.max_image_bytes, max_image_pixels=self.max_image_pixels,
                           max_video_bytes=self.max_video_bytes, max_video_frames=self.max_video_frames,
                           max_request_video_pixels=self.max_request_video_pixels,
                           video_decode_timeout_s=self.video_decode_timeout_s)

    @property
    def mm_cache_bytes(self) -> int:
        return int(self.mm_cache_gb * (1 << 30))

    def num_worker_threads(self) -> int:
        """Torch threads: `--threads-per-worker`, else `epd serve`'s rule
        (epd/processes/threads.py) for a host where this is the only worker."""
        return self.num_threads or worker_threads(self.role, [self.role], available_cores(), self.cpu_sharing)


def _check_scaling(config: ServeConfig) -> None:
    scaling = config.encoder_scaling
    if scaling is None:
        return
    if config.mode is Mode.AGGREGATED:
        raise ValueError("--encoders MIN-MAX needs a mode with encoder workers (e-pd or e-p-d)")
    if config.external_workers:
        raise ValueError("--encoders MIN-MAX needs workers this launcher starts (not --external-workers)")
    if scaling.min_encoders != config.num_encoders:
        raise ValueError(f"--encoders: {config.num_encoders} encoders to start, but the range starts at "
                         f"{scaling.min_encoders}")
    if scaling.max_encoders > MAX_ENCODERS:
        raise ValueError(f"--encoders MIN-MAX: MAX may be at most {MAX_ENCODERS}, got {scaling.max_encoders}")


def _check_keys(keys_dir: str | None, role: str, what: str) -> None:
    """Worker sockets on tcp are always authenticated: the keys must be there and readable."""
    if not keys_dir:
        raise ValueError(f"{what} listens on tcp: pass --worker-keys DIR (make the keys once with "
                         f"`epd keys DIR` and copy the directory to every host)")
    try:
        PlaneKeys.load(keys_dir, role)
    except PlaneKeyError as exc:
        raise ValueError(str(exc)) from None
