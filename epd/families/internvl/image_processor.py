"""Decoded images -> InternViT's input, through the checkpoint's own image
processor (transformers' GotOcr2 image processor, `AutoImageProcessor`) with
the settings InternVLProcessor gives it: tiles cropped (`crop_to_patches`
true unless --mm-processor-kwargs says otherwise) between the files'
min/max_patches. Each image's tile count is checked against `TileGeometry`
(prompt_format.py), the torch-free rule the API counted its placeholders by.
"""
from __future__ import annotations

from pathlib import Path

import torch

from epd.families.internvl.prompt_format import TileGeometry


class TilePreprocessor:
    """Images -> (pixel_values [total tiles, 3, size, size], tiles per image)."""

    def __init__(self, model_dir: str | Path, processor_kwargs: dict | None = None):
        from transformers import AutoImageProcessor

        self.geometry = TileGeometry.from_pretrained(model_dir, processor_kwargs)
        self.processor = AutoImageProcessor.from_pretrained(str(model_dir))
        g = self.geometry
        self.kwargs = dict(crop_to_patches=g.crop_to_patches, min_patches=g.min_patches, max_patches=g.max_patches)

    def __call__(self, images: list) -> tuple[torch.Tensor, list[int]]:
        out = self.processor(images=images, return_tensors="pt", **self.kwargs)
        num_tiles = [int(n) for n in out["num_patches"]]
        for image, n in zip(images, num_tiles):
            expected = self.geometry.num_tiles(image.width, image.height)
            if n != expected:
                raise ValueError(f"image {image.width}x{image.height}: the processor made {n} tiles, "
                                 f"the geometry counted {expected}")
        return out["pixel_values"], num_tiles
