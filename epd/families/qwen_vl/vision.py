"""The Qwen families' vision side: the checkpoint's tower, built and filled, with its image processor.

One tower per family, chosen by config.json's `model_type`: Qwen3-VL and
Qwen3-VL-MoE share vision_tower.py (deepstack features become each entry's
"deepstack.i" extras), Qwen2.5-VL has qwen2_5_vision_tower.py. `QwenVision`
is what the encoders use (epd/families/model_family.py `ModelFamily.vision`).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from epd.families.qwen_vl.image_processor import ImagePreprocessor
from epd.families.qwen_vl.qwen2_5_vision_tower import Qwen2_5VisionConfig, Qwen2_5VisionTower
from epd.families.qwen_vl.vision_tower import VisionConfig, VisionTower, deepstack_extras
from epd.transport.embedding_cache.mm_entry import MMEntry
from epd.transport.weights.checkpoint import load_weights, materialize

_VISION_PREFIXES = ("model.visual.", "visual.")

# model_type -> (config class, tower class)
TOWERS = {
    "qwen3_vl": (VisionConfig, VisionTower),
    "qwen3_vl_moe": (VisionConfig, VisionTower),
    "qwen2_5_vl": (Qwen2_5VisionConfig, Qwen2_5VisionTower),
    # Qwen3.5's tower is Qwen3-VL's without deepstack (epd/families/qwen3_5/)
    "qwen3_5": (VisionConfig, VisionTower),
    "qwen3_5_moe": (VisionConfig, VisionTower),
}


def _vision_rule(name: str):
    for prefix in _VISION_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):], None
    return None


def load_vision_tower(model_dir: str | Path, hf_config, dtype: torch.dtype, device: str | torch.device = "cpu", *,
                      model_type: str | None = None, rule=None, fused: dict[str, list[int]] | None = None,
                      describe=None) -> nn.Module:
    """A family with one of these towers under its own names (Qwen2.5-Omni's thinker) gives the
    `model_type` whose tower it is, its name `rule`, its `fused` pieces and `describe` (load_weights')."""
    model_type = model_type or getattr(hf_config, "model_type", None)
    if model_type not in TOWERS:
        raise ValueError(f"no vision tower for model_type {model_type!r}; known: {', '.join(TOWERS)}")
    config_cls, tower_cls = TOWERS[model_type]
    cfg = config_cls.from_hf(hf_config.vision_config)
    with torch.device("meta"):
        tower = tower_cls(cfg)
    tower = materialize(tower, device, dtype)
    tower.reset_rotary(device)
    load_weights(tower, model_dir, rule or _vision_rule, fused=fused,
                 describe=describe or (lambda p, s: "model.visual." + p))
    return tower.eval()


class QwenVision:
    """Decoded images -> one MMEntry each (embeddings, deepstack extras, {"grid_thw": (t, h, w)})."""

    def __init__(self, model_dir: str | Path, hf_config, dtype: torch.dtype, device: str = "cpu",
                 processor_kwargs: dict | None = None, load_tower=load_vision_tower):
        """`load_tower`: a family with its own names for one of these towers gives its loader."""
        self.preprocessor = ImagePreprocessor(model_dir, processor_kwargs)
        self.geometry = self.preprocessor.geometry
        self.tower = load_tower(model_dir, hf_config, dtype, device)
        self.dtype, self.device = dtype, device

    def patches(self, width: int, height: int) -> int:
        """The image's tower patches (ValueError for a size the processor refuses)."""
        return self.geometry.patches(width, height)

    def preprocess(self, images: list) -> tuple[torch.Tensor, list[dict]]:
        pixel_values, grids = self.preprocessor(images)
        return pixel_values, [{"grid_thw": g} for g in grids]

    def forward(self, pixel_values: torch.Tensor, metas: list[dict]) -> list[MMEntry]:
        """One entry per grid of `metas` (an image, or a video's temporal group)."""
        result = self.tower(pixel_values.to(self.device, self.dtype), [m["grid_thw"] for m in metas])
        return [MMEntry(e, deepstack_extras(d), dict(m)) for e, d, m in zip(result.embeds, result.deepstack, metas)]


def load_vision(model_dir, hf_config, dtype, device="cpu", processor_kwargs=None) -> QwenVision:
    return QwenVision(model_dir, hf_config, dtype, device, processor_kwargs)
