"""Image geometry of the Qwen2-VL image processor (Qwen3-VL, Qwen3-VL-MoE and
Qwen2.5-VL checkpoints), torch-free: `ImageGeometry` answers "how many
placeholder tokens will this image take?" from its width and height alone (the
API process relies on it and never decodes pixels). The settings (patch size,
pixel limits) come from each checkpoint's preprocessor_config.json, whether the
limits are written as `size` or as top-level min/max_pixels; the encoder's
`ImagePreprocessor` (epd/families/qwen_vl/image_processor.py) resizes by the same rule.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

MAX_ASPECT_RATIO = 200  # the Qwen2/3-VL image processors refuse anything longer
PROCESSOR_CONFIG = "preprocessor_config.json"  # without it a checkpoint serves text only
NO_IMAGE_PROCESSOR = f"this checkpoint has no {PROCESSOR_CONFIG} (no image processor): it serves text only"
# --mm-processor-kwargs keys the Qwen image processor takes and `ImageGeometry` models (pixel bounds of the resize)
PROCESSOR_KWARGS = ("min_pixels", "max_pixels")


def check_processor_kwargs(kwargs: dict) -> None:
    """ValueError for an --mm-processor-kwargs key we cannot apply, or a bad value."""
    unknown = sorted(set(kwargs) - set(PROCESSOR_KWARGS))
    if unknown:
        raise ValueError(f"--mm-processor-kwargs: {', '.join(unknown)} cannot be applied here; the image "
                         f"processor takes {', '.join(PROCESSOR_KWARGS)}")
    for key, value in kwargs.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--mm-processor-kwargs: {key} must be a positive integer, got {value!r}")
    if kwargs.get("min_pixels", 0) > kwargs.get("max_pixels", float("inf")):
        raise ValueError(f"--mm-processor-kwargs: min_pixels {kwargs['min_pixels']} is more than "
                         f"max_pixels {kwargs['max_pixels']}")


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's `smart_resize` (its image and video processors): (height, width)
    as multiples of `factor`, the area within [min_pixels, max_pixels], the
    aspect kept as near as may be. The caller checks sizes first."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class ImageGeometry:
    """The resize rule of the checkpoint's image processor (`smart_resize`)."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, processor_kwargs: dict | None = None) -> "ImageGeometry":
        """`processor_kwargs` (--mm-processor-kwargs): min_pixels / max_pixels over the file's."""
        cfg = {**json.loads((Path(model_dir) / "preprocessor_config.json").read_text()), **(processor_kwargs or {})}
        size = cfg.get("size") or {}
        min_pixels = cfg.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or 56 * 56
        max_pixels = (cfg.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels")
                      or 28 * 28 * 1280)
        return cls(
            patch_size=int(cfg.get("patch_size", 14)),
            merge_size=int(cfg.get("merge_size", 2)),
            temporal_patch_size=int(cfg.get("temporal_patch_size", 2)),
            min_pixels=int(min_pixels),
            max_pixels=int(max_pixels),
        )

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) after the processor's resize; raises ValueError for
        sizes the processor refuses (zero-sized, aspect ratio over 200)."""
        if width < 1 or height < 1:
            raise ValueError(f"image has an empty dimension ({width}x{height})")
        if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
            raise ValueError(f"image aspect ratio {width}x{height} exceeds {MAX_ASPECT_RATIO}:1")
        h_bar, w_bar = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return w_bar, h_bar

    def grid_thw(self, width: int, height: int) -> tuple[int, int, int]:
        """Vision grid in patches (t, h, w) for a still image."""
        w, h = self.resized_size(width, height)
        return 1, h // self.patch_size, w // self.patch_size

    def num_image_tokens(self, width: int, height: int) -> int:
        """Placeholder tokens the image takes in the prompt (merged patches)."""
        t, h, w = self.grid_thw(width, height)
        return t * h * w // self.merge_size ** 2

    def patches(self, width: int, height: int) -> int:
        """The tower's patches (t x h x w)."""
        t, h, w = self.grid_thw(width, height)
        return t * h * w

    def span_meta(self, width: int, height: int) -> dict:
        """{"grid_thw": (t, h, w)}: what M-RoPE places the image's tokens by."""
        return {"grid_thw": self.grid_thw(width, height)}
