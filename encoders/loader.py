"""Builds a checkpoint's vision tower and fills it from safetensors.

One tower per family, chosen by config.json's `model_type` (the engine's
registry, engine/models/registry.py, checks the family at start-up; encoders
cannot import it): Qwen3-VL and Qwen3-VL-MoE share encoders/vision_tower.py,
Qwen2.5-VL has encoders/qwen2_5_vision_tower.py.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from epd.encoders.qwen2_5_vision_tower import Qwen2_5VisionConfig, Qwen2_5VisionTower
from epd.encoders.vision_tower import VisionConfig, VisionTower
from epd.transport.weights.checkpoint import load_weights, materialize

_VISION_PREFIXES = ("model.visual.", "visual.")

# model_type -> (config class, tower class)
TOWERS = {
    "qwen3_vl": (VisionConfig, VisionTower),
    "qwen3_vl_moe": (VisionConfig, VisionTower),
    "qwen2_5_vl": (Qwen2_5VisionConfig, Qwen2_5VisionTower),
}


def _vision_rule(name: str):
    for prefix in _VISION_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):], None
    return None


def load_vision_tower(model_dir: str | Path, hf_config, dtype: torch.dtype,
                      device: str | torch.device = "cpu") -> nn.Module:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in TOWERS:
        raise ValueError(f"no vision tower for model_type {model_type!r}; known: {', '.join(TOWERS)}")
    config_cls, tower_cls = TOWERS[model_type]
    cfg = config_cls.from_hf(hf_config.vision_config)
    with torch.device("meta"):
        tower = tower_cls(cfg)
    tower = materialize(tower, device, dtype)
    tower.reset_rotary(device)
    load_weights(tower, model_dir, _vision_rule, describe=lambda p, s: "model.visual." + p)
    return tower.eval()
