"""Decoded images -> Gemma 3's tower input, through the checkpoint's own
transformers image processor (AutoImageProcessor: Gemma3ImageProcessor with
the settings of its preprocessor_config.json): each image resized to the
tower's square input, rescaled and normalised. Pan-and-scan stays off (the
geometry, prompt_format.py, refuses it), so each image is one crop.
"""
from __future__ import annotations

from pathlib import Path

import torch

from epd.families.gemma3.prompt_format import PAN_AND_SCAN, Gemma3Geometry


class Gemma3ImageProcessor:
    """Decoded images -> pixel_values [num_images, C, S, S]."""

    def __init__(self, model_dir: str | Path, hf_config=None, processor_kwargs: dict | None = None):
        from transformers import AutoImageProcessor

        self.geometry = Gemma3Geometry.from_pretrained(model_dir, processor_kwargs)
        self.processor = AutoImageProcessor.from_pretrained(str(model_dir), **{PAN_AND_SCAN: False})

    def __call__(self, images: list) -> torch.Tensor:
        out = self.processor(images=images, return_tensors="pt", **{PAN_AND_SCAN: False})
        pixel_values = out["pixel_values"]
        side = self.geometry.image_size
        assert pixel_values.shape[0] == len(images) and pixel_values.shape[-2:] == (side, side), pixel_values.shape
        return pixel_values
