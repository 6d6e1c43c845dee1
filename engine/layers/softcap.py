"""Soft-capping: values squashed smoothly into (-cap, cap), as transformers does it.

A text model's `compute_logits` applies the final-logit cap where its config has one
(Gemma 2's `final_logit_softcapping`; None in Gemma 3's releases); the attention backends
cap scores themselves (engine/attention/, their `softcap` option).
"""
from __future__ import annotations

import torch


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """`cap * tanh(x / cap)` (transformers' three steps, in that order); `x` itself when `cap` is None."""
    if cap is None:
        return x
    return torch.tanh(x / cap) * cap
