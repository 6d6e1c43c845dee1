"""GLM-4.1V's image preprocessing: decoded images -> the tower's input, through
the checkpoint's own image processor (AutoImageProcessor: Glm4vImageProcessor,
its `smart_resize` and temporal patches of 2), with the `size` the geometry
(prompt_format.py `Glm4vImageGeometry`) counted the prompt's tokens by."""
from __future__ import annotations

from pathlib import Path

import torch

from epd.families.glm4v.prompt_format import Glm4vImageGeometry


class Glm4vImagePreprocessor:
    """PIL images -> (pixel_values [num_patches, C*t*p*p], one {"grid_thw": (t, h, w)} per image)."""

    def __init__(self, model_dir: str | Path, processor_kwargs: dict | None = None):
        from transformers import AutoImageProcessor

        self.geometry = Glm4vImageGeometry.from_pretrained(model_dir, processor_kwargs)
        self.processor = AutoImageProcessor.from_pretrained(str(model_dir), size=self.geometry.size)

    def __call__(self, images: list) -> tuple[torch.Tensor, list[dict]]:
        out = self.processor(images=images, return_tensors="pt")
        grids = [tuple(int(v) for v in g) for g in out["image_grid_thw"].tolist()]
        for image, grid in zip(images, grids):
            counted = self.geometry.grid_thw(image.width, image.height)
            if grid != counted:  # the prompt holds the geometry's count of tokens
                raise ValueError(f"the image processor gave a {image.width}x{image.height} image the grid "
                                 f"{grid}; its geometry counted {counted}")
        return out["pixel_values"], [{"grid_thw": g} for g in grids]
