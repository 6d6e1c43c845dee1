"""The scheduler's launch-time limits (frozen; part of `EngineConfig`).

Pure Python (no torch).
"""
from __future__ import annotations

from dataclasses import dataclass

ROLES = ("pd", "prefill", "decode")
PREFILL_PRIORITIES = ("fcfs", "cost")


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling limits chosen at launch.

    The number of KV blocks is discovered at run time (memory profiling), so
    it is a `Scheduler` argument, not a config field. `max_model_len=None`
    means "as long as the KV cache allows".
    """

    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    # Which prefill gets the token budget first: "fcfs" (arrival) or "cost"
    # (fewest tokens left to prefill, aged; see `PrefillOrder.priority`).
    prefill_priority: str = "cost"
    # Aging of "cost": a request gains `prefill_aging` tokens of priority per
    # token the engine schedules after it arrived.
    prefill_aging: float = 0.1
    # Requests that may hold KV blocks while an image they need is missing.
    max_num_image_waits: int = 4
    # Conditional disaggregation (e-p-d): a text-only prompt of at most this many
    # tokens is prefilled on a decode worker instead of the prefill worker, and a
    # decode worker's step computes at most this many prompt tokens beside its
    # decodes. 0: off (a decode worker takes prefilled requests only).
    max_local_prefill_tokens: int = 512

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_num_image_waits"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.prefill_priority not in PREFILL_PRIORITIES:
            raise ValueError(f"prefill_priority must be one of {', '.join(PREFILL_PRIORITIES)}, "
                             f"got {self.prefill_priority!r}")
        if self.max_local_prefill_tokens < 0:
            raise ValueError(f"max_local_prefill_tokens must be non-negative, got {self.max_local_prefill_tokens}")
        if not self.prefill_aging > 0:
            raise ValueError(f"prefill_aging must be positive, got {self.prefill_aging}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
