"""The language model of a checkpoint, built by its family, and the dtype it runs in.

The family (epd/families/registry.py) builds and fills its own model from the
checkpoint's names (its package's text_loader.py); what the engine gets is a
model with `cfg`, `positions`, `forward`, `forward_with_aux` and
`compute_logits` (epd/families/model_family.py).
"""
from __future__ import annotations

from pathlib import Path

import torch

from epd.families.registry import family_of


def resolve_dtype(dtype: str, checkpoint_dtype: str) -> torch.dtype:
    name = checkpoint_dtype if dtype == "auto" else dtype
    name = {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp32": "float32",
            "fp16": "float16"}.get(name, name)
    if name not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"unsupported dtype {dtype!r} (use auto, float32, float16 or bfloat16)")
    return getattr(torch, name)


def load_language_model(model_dir: str | Path, hf_config, dtype: torch.dtype, device: str | torch.device = "cpu"):
    """The checkpoint's language model, filled and in eval mode, as its family builds it."""
    return family_of(hf_config).load_text_model(model_dir, hf_config, dtype, device)
