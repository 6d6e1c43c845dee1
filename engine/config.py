"""The engine's launch-time configuration (frozen, built once by the CLI or `LLM`)."""
from __future__ import annotations

from dataclasses import dataclass

from epd.engine.scheduler import SchedulerConfig

DEFAULT_CPU_KV_CACHE_GB = 1.0
# Worker roles that run an engine (and hold a KV cache) -> the EngineCore role they run.
ENGINE_ROLES = {"prefill": "prefill", "decode": "decode", "pd": "combined", "aggregated": "combined"}


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings with vLLM's names.

    KV cache size: `num_kv_blocks` wins, then `kv_cache_gb`; otherwise on GPU
    `gpu_memory_utilization` of the card after profiling one forward pass,
    on CPU `DEFAULT_CPU_KV_CACHE_GB`.
    """

    num_kv_blocks: int | None = None
    kv_cache_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"  # torch on CPU, triton on GPU

    def __post_init__(self) -> None:
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be positive, got {self.kv_cache_gb}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")
        self.scheduler_config()  # validates the scheduling limits

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(block_size=self.block_size, max_num_seqs=self.max_num_seqs,
                               max_num_batched_tokens=self.max_num_batched_tokens,
                               enable_prefix_caching=self.enable_prefix_caching,
                               max_model_len=self.max_model_len)

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_max_model_len(self, model_max_len: int) -> int:
        """`max_model_len` if set, never beyond what the checkpoint supports."""
        return min(self.max_model_len or model_max_len, model_max_len)

    def resolved_backend(self, device: str) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        return "triton" if device.startswith("cuda") else "torch"
