"""The engine's launch-time configuration (frozen, built once by the CLI or `LLM`).

    EngineConfig            memory, precision, device, attention backend, early prefill
      scheduler: SchedulerConfig    block size, batch limits, prefix caching, max_model_len,
                                    prefill priority
      speculative_config: SpeculativeConfig | None   speculative decoding (engine/spec/config.py)
      lora: LoRAConfig              enable_lora, max_loras, max_lora_rank, max_cpu_loras
      kv_events_config: KVEventsConfig | None   vLLM's KV events from the block manager
                                    (transport/wire/kv_events.py)

`EngineConfig.from_flat(**settings)` takes the flat vLLM names of all three
(`max_num_seqs=8, device="cpu", enable_lora=True`), as `LLM(...)` and the CLI flags do.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from epd.engine.lora.config import LoRAConfig
from epd.engine.scheduler_config import SchedulerConfig
from epd.engine.spec.config import SpeculativeConfig
from epd.transport.wire.kv_events import KVEventsConfig

DEFAULT_CPU_KV_CACHE_GB = 1.0
DTYPES = ("auto", "float32", "float16", "bfloat16")
# vLLM's --kv-cache-dtype: auto (the model's dtype) or an fp8 format (engine/attention/fp8_kv.py; fp8 = fp8_e4m3)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
VLLM_DTYPES = {"half": "float16", "float": "float32"}  # vLLM's other --dtype names -> ours
# every other name taken for a precision -> ours (one name per precision in the config)
DTYPE_ALIASES = {**VLLM_DTYPES, "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings with vLLM's names.

    KV cache size: `num_kv_blocks` wins, then `kv_cache_gb`; otherwise on GPU
    `gpu_memory_utilization` of the card after profiling one forward pass,
    on CPU `DEFAULT_CPU_KV_CACHE_GB`.
    """

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    num_kv_blocks: int | None = None
    kv_cache_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"  # torch on CPU, triton on GPU
    # A worker admits a request before all its images are here and prefills
    # up to the first missing one (engine/worker/image_arrivals.py); off: it waits for all.
    # None: on, except where `epd serve` decides otherwise (ServeConfig.worker_engines).
    early_prefill: bool | None = None
    seed: int = 0  # vLLM's --seed: the torch seed of every engine; unseeded requests sample from it
    # vLLM's --speculative-config: given as its JSON text or a dict, kept typed (None: no speculation)
    speculative_config: SpeculativeConfig | None = None
    # vLLM's: CUDA graphs replay decode steps on a GPU (engine/cuda_graphs.py) unless enforce_eager;
    # graphs for batches of up to max_cudagraph_capture_size sequences (None: min(2 x max_num_seqs, 512))
    enforce_eager: bool = False
    max_cudagraph_capture_size: int | None = None
    # vLLM's --kv-events-config: given as its JSON text or a dict, kept typed (None: no events)
    kv_events_config: KVEventsConfig | None = None
    # vLLM's --tensor-parallel-size: the engine's language model over this many ranks (engine/parallel/)
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        object.__setattr__(self, "kv_events_config", KVEventsConfig.parse(self.kv_events_config))
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (or vLLM's half, float), got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be positive, got {self.kv_cache_gb}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.max_cudagraph_capture_size is not None and self.max_cudagraph_capture_size < 0:
            raise ValueError(f"max_cudagraph_capture_size must be non-negative, got {self.max_cudagraph_capture_size}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")

    @classmethod
    def from_flat(cls, **settings: Any) -> EngineConfig:
        """From the flat names of this class's and `SchedulerConfig`'s fields;
        TypeError naming any other."""
        own, sched, lora = _field_names(cls) - _NESTED, _field_names(SchedulerConfig), _field_names(LoRAConfig)
        unknown = set(settings) - own - sched - lora
        if unknown:
            raise TypeError(f"unknown engine setting(s) {', '.join(sorted(unknown))}; "
                            f"expected some of {', '.join(sorted(own | sched | lora))}")
        return cls(scheduler=SchedulerConfig(**{k: v for k, v in settings.items() if k in sched}),
                   lora=LoRAConfig(**{k: v for k, v in settings.items() if k in lora}),
                   **{k: v for k, v in settings.items() if k in own})

    @classmethod
    def flat_defaults(cls) -> dict[str, Any]:
        """Every flat setting `from_flat` takes, with its default."""
        config = cls()
        return {**dataclasses.asdict(config.scheduler), **dataclasses.asdict(config.lora),
                **{name: getattr(config, name) for name in _field_names(cls) - _NESTED}}

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_max_model_len(self, model_max_len: int) -> int:
        """`max_model_len` if set, else the checkpoint's; ValueError (naming both)
        when it is set beyond what the checkpoint supports, as vLLM refuses it."""
        asked = self.scheduler.max_model_len
        if asked is not None and asked > model_max_len:
            raise ValueError(f"--max-model-len {asked} is more than this model's limit of {model_max_len} tokens "
                             f"(max_position_embeddings in config.json)")
        return asked or model_max_len

    def resolved_backend(self, device: str) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        return "triton" if device.startswith("cuda") else "torch"


_NESTED = {"scheduler", "lora"}


def _field_names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}
