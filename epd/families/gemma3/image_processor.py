"""Decoded images -> Gemma 3's tower input, through the checkpoint's own
transformers image processor (AutoImageProcessor: Gemma3ImageProcessor with
the settings of its preprocessor_config.json under --mm-processor-kwargs):
each image, and with pan-and-scan on each of its crops after it, resized to
the tower's square input, rescaled and normalised. The pan-and-scan settings
are passed whole (the geometry's, prompt_format.py), so the crops are the
ones the prompt was written for.
"""
from __future__ import annotations

from pathlib import Path

import torch

from epd.families.gemma3.prompt_format import (MAX_NUM_CROPS, MIN_CROP_SIZE, MIN_RATIO, PAN_AND_SCAN,
                                               Gemma3Geometry)


class Gemma3ImageProcessor:
    """Decoded images -> pixel_values [num_crops, C, S, S]: each image's original, then its crops."""

    def __init__(self, model_dir: str | Path, hf_config=None, processor_kwargs: dict | None = None):
        from transformers import AutoImageProcessor

        self.geometry = Gemma3Geometry.from_pretrained(model_dir, processor_kwargs)
        pas = self.geometry.pan_and_scan
        self.settings = {PAN_AND_SCAN: False} if pas is None else {
            PAN_AND_SCAN: True, MIN_CROP_SIZE: pas.min_crop_size, MAX_NUM_CROPS: pas.max_num_crops,
            MIN_RATIO: pas.min_ratio_to_activate}
        self.processor = AutoImageProcessor.from_pretrained(str(model_dir), **self.settings)

    def num_crops(self, images: list) -> list[int]:
        """Each image's pan-and-scan crops besides its original, from its size (the geometry's)."""
        return [self.geometry.num_crops(*image.size) for image in images]

    def __call__(self, images: list) -> torch.Tensor:
        out = self.processor(images=images, return_tensors="pt", **self.settings)
        pixel_values = out["pixel_values"]
        num_crops = self.num_crops(images)
        got = [int(n) for n in out["num_crops"]]
        if got != num_crops:  # the geometry wrote the prompt for its own count
            raise RuntimeError(f"the image processor cut {got} crops where the geometry counts {num_crops}")
        side = self.geometry.image_size
        assert pixel_values.shape[0] == len(images) + sum(num_crops), pixel_values.shape
        assert pixel_values.shape[-2:] == (side, side), pixel_values.shape
        return pixel_values
