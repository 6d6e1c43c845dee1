"""Raw image bytes -> vision embeddings: decode, preprocess, run the ViT.

Used in-process by the aggregated worker and the offline `LLM`, and by the
encoder worker. Images are batched through the tower up to a patch budget.
Each image's output is an `MMEntry` (transport/mm_entry.py): the one type
the cache stores, EncodeDone carries and the engine consumes.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from epd.encoders.image_io import DEFAULT_MAX_IMAGE_PIXELS, load_image
from epd.encoders.image_processor import ImagePreprocessor
from epd.encoders.loader import load_vision_tower
from epd.transport.mm_cache import mm_hash
from epd.transport.mm_entry import MMEntry

DEFAULT_MAX_BATCH_PATCHES = 16384


class ImageEncoder:
    def __init__(self, model_dir: str | Path, hf_config, dtype: torch.dtype, device: str = "cpu",
                 model_fingerprint: str = "", max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                 max_batch_patches: int = DEFAULT_MAX_BATCH_PATCHES):
        self.preprocess = ImagePreprocessor(model_dir)
        self.tower = load_vision_tower(model_dir, hf_config, dtype, device)
        self.device = device
        self.dtype = dtype
        self.model_fingerprint = model_fingerprint
        self.processor_config = json.loads((Path(model_dir) / "preprocessor_config.json").read_text())
        self.max_image_pixels = max_image_pixels
        self.max_batch_patches = max_batch_patches

    def mm_hash(self, image_bytes: bytes) -> str:
        """Content key of an image for this model and image processor."""
        return mm_hash(image_bytes, self.model_fingerprint, self.processor_config)

    @torch.inference_mode()
    def encode(self, images: list[bytes]) -> list[MMEntry]:
        """Encodes raw images (raises encoders.image_io.ImageError on bad bytes)."""
        decoded = [load_image(data, self.max_image_pixels) for data in images]
        geometry = self.preprocess.geometry
        out: list[MMEntry] = []
        batch: list = []
        batch_patches = 0
        for img in decoded:
            t, h, w = geometry.grid_thw(*img.size)
            if batch and batch_patches + t * h * w > self.max_batch_patches:
                out += self._run(batch)
                batch, batch_patches = [], 0
            batch.append(img)
            batch_patches += t * h * w
        if batch:
            out += self._run(batch)
        return out

    def _run(self, images: list) -> list[MMEntry]:
        pixel_values, grids = self.preprocess(images)
        result = self.tower(pixel_values.to(self.device, self.dtype), grids)
        # deepstack [num_deepstack, num_tokens, out_hidden] -> views, each [num_tokens, out_hidden]
        return [MMEntry(e, list(d.unbind(0)), g) for e, d, g in zip(result.embeds, result.deepstack, grids)]
