"""`LoRAConfig`: the launch-time LoRA limits, with vLLM's names and defaults.

Pure Python (no torch); part of `EngineConfig` (`EngineConfig.lora`).
"""
from __future__ import annotations

from dataclasses import dataclass

# vLLM's MaxLoRARanks: the ranks --max-lora-rank may take
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class LoRAConfig:
    """`enable_lora` off: requests with an adapter are refused and the model is
    not wrapped. `max_loras` adapters are resident in device slots at once
    (and so at most that many distinct adapters run in one step);
    `max_cpu_loras` (None: `max_loras`) are kept read in host memory.
    `enable_tower_lora` (beyond vLLM's default; its `enable_tower_connector_lora`):
    an adapter's vision tower weights run on the encoders, which keep the same
    number of slots and host entries of their own (encoders/tower_lora.py)."""

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    enable_tower_lora: bool = False

    def __post_init__(self) -> None:
        if self.enable_tower_lora and not self.enable_lora:
            raise ValueError("enable_tower_lora (--enable-tower-lora) needs enable_lora (--enable-lora)")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank not in MAX_LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {', '.join(map(str, MAX_LORA_RANKS))} "
                             f"(as vLLM's), got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")

    @property
    def num_cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


def fits_adapter_limit(running, lora_key, max_loras: int) -> bool:
    """Whether a request with adapter `lora_key` may join the `running` requests
    (each with `lora_key`) under `max_loras` distinct adapters at once (0: no limit):
    a step runs only running requests, so it never needs more slots than that."""
    if lora_key is None or not max_loras:
        return True
    keys = {r.lora_key for r in running if r.lora_key is not None}
    return lora_key in keys or len(keys) < max_loras
