"""Builds the Qwen3-VL vision tower and fills it from a safetensors checkpoint."""
from __future__ import annotations

from pathlib import Path

import torch

from epd.encoders.vision_tower import VisionConfig, VisionTower
from epd.transport.checkpoint import load_weights

_VISION_PREFIXES = ("model.visual.", "visual.")


def _vision_rule(name: str):
    for prefix in _VISION_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):], None
    return None


def load_vision_tower(model_dir: str | Path, hf_config, dtype: torch.dtype,
                      device: str | torch.device = "cpu") -> VisionTower:
    cfg = VisionConfig.from_hf(hf_config.vision_config)
    with torch.device("meta"):
        tower = VisionTower(cfg)
    tower = tower.to_empty(device=device).to(dtype)
    tower.reset_rotary(device)
    load_weights(tower, model_dir, _vision_rule, describe=lambda p, s: "model.visual." + p)
    return tower.eval()
