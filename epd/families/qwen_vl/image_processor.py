"""Image preprocessing for Qwen3-VL, Qwen3-VL-MoE and Qwen2.5-VL checkpoints
(all use Qwen2-VL's image processor, with the settings of each checkpoint's
preprocessor_config.json): `ImagePreprocessor` turns decoded images into the
vision tower's input through the checkpoint's own `AutoImageProcessor`, and
checks its grid against `ImageGeometry` (transport/media/image_geometry.py),
the torch-free rule the API counts placeholder tokens by.
"""
from __future__ import annotations

from pathlib import Path

from epd.transport.media.image_geometry import ImageGeometry


class ImagePreprocessor:
    """Decoded images -> (pixel_values [num_patches, C*t*p*p], grid_thw per image)."""

    def __init__(self, model_dir: str | Path, processor_kwargs: dict | None = None):
        from transformers import AutoImageProcessor

        kwargs = processor_kwargs or {}
        self.processor = AutoImageProcessor.from_pretrained(str(model_dir), **kwargs)
        self.geometry = ImageGeometry.from_pretrained(model_dir, kwargs)

    def __call__(self, images: list) -> tuple["torch.Tensor", list[tuple[int, int, int]]]:  # noqa: F821
        out = self.processor(images=images, return_tensors="pt")
        grids = [tuple(int(v) for v in g) for g in out["image_grid_thw"].tolist()]
        return out["pixel_values"], grids
