"""Raw image bytes -> vision embeddings: decode, preprocess, run the ViT.

The family's vision side (epd/families/model_family.py `ModelFamily.vision`)
preprocesses and runs its tower; this class decodes, batches and keys.

Used in-process by the aggregated worker and the offline `LLM`, and by the
encoder worker. Images are batched through the tower up to a patch budget.
With tower LoRA (`tower_lora`, --enable-tower-lora) the tower's projections
are wrapped (encoders/tower_lora.py) and `encode(images, lora=...)` runs the
adapter's tower weights; its images are keyed apart (`mm_hash(..., adapter_digest)`).
Each image's output is an `MMEntry` (transport/embedding_cache/mm_entry.py): the one type
the cache stores, EncodeDone carries and the engine consumes.
"""
from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from epd.encoders.image_io import DEFAULT_MAX_IMAGE_PIXELS, ImageError, load_image, read_image_size
from epd.transport.media.image_geometry import NO_IMAGE_PROCESSOR, PROCESSOR_CONFIG
from epd.families.registry import family_of
from epd.encoders.tower_lora import TowerLoRA, TowerLoRASettings
from epd.transport.wire.lora_request import LoRARequest
from epd.transport.embedding_cache.mm_cache import adapted_mm_hash, mm_hash
from epd.transport.embedding_cache.mm_entry import MMEntry
from epd.transport.weights.cpu_linear import pack_linears
from epd.transport.weights.quant.int8_linear import float_linears

# (images in the batch, decode + preprocessing seconds, ViT forward seconds)
BatchTimer = Callable[[int, float, float], None]
# (frames decoded, decode seconds) of one item: an image is one frame (a video: encoders/video_request.py)
DecodeTimer = Callable[[int, float], None]
DEFAULT_MAX_BATCH_PATCHES = 16384
# Full-resolution pixels decoded at once: a batch closes before it would pass this
# (one image larger than it is decoded alone). Headers give sizes without decoding.
DEFAULT_MAX_DECODED_PIXELS = DEFAULT_MAX_IMAGE_PIXELS


class ImageEncoder:
    def __init__(self, model_dir: str | Path, hf_config, dtype: torch.dtype, device: str = "cpu",
                 model_fingerprint: str = "", max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                 max_batch_patches: int = DEFAULT_MAX_BATCH_PATCHES,
                 max_decoded_pixels: int = DEFAULT_MAX_DECODED_PIXELS, processor_kwargs: dict | None = None,
                 tower_lora: TowerLoRASettings | None = None):
        """`processor_kwargs` (--mm-processor-kwargs): the image processor's settings over the file's
        (its video keys are the API's: a video comes with its plan). `tower_lora`
        (--enable-tower-lora): the tower's adapter slots; None: adapters never reach the tower."""
        # a text-only checkpoint (no preprocessor_config.json): no processor, no tower, every image refused
        has_processor = (Path(model_dir) / PROCESSOR_CONFIG).is_file()
        family = family_of(hf_config)
        processor_kwargs = {k: v for k, v in (processor_kwargs or {}).items() if k in family.prompt_format.image_kwargs}
        self.vision = (family.load_vision(model_dir, hf_config, dtype, device, processor_kwargs)
                       if has_processor else None)
        self.tower = None if self.vision is None else self.vision.tower  # what tower LoRA wraps
        # the projections wrapped before the packing, which then reaches the base inside each wrapper
        # a family whose tower takes no adapter: none wrapped, and an adapter for it refused by name (`adapted`)
        self.family_name = None if family.tower_lora else family.name
        if self.tower is not None and tower_lora and family.tower_lora:
            float_linears(self.tower)  # a W8A8 tower's Int8Linears dequantized: the adapters wrap float linears
        self.lora = (TowerLoRA(self.tower, tower_lora) if self.tower is not None and tower_lora and family.tower_lora
                     else None)
        if self.tower is not None:
            pack_linears(self.tower)  # CPU float32: oneDNN with packed weights (transport/weights/cpu_linear.py)
        self.device = device
        self.dtype = dtype
        self.model_fingerprint = model_fingerprint
        # the settings it runs with, part of every mm_hash (the API hashes the same merge: ModelFiles)
        self.processor_config = {**json.loads((Path(model_dir) / PROCESSOR_CONFIG).read_text()),
                                 **processor_kwargs} if has_processor else {}
        self.max_image_pixels = max_image_pixels
        self.max_batch_patches = max_batch_patches
        self.max_decoded_pixels = max_decoded_pixels

    def mm_hash(self, image_bytes: bytes, adapter_digest: str | None = None) -> str:
        """Content key of an image for this model and image processor (and the tower
        adapter whose files hash to `adapter_digest`, if any)."""
        key = mm_hash(image_bytes, self.model_fingerprint, self.processor_config)
        return key if adapter_digest is None else adapted_mm_hash(key, adapter_digest)

    @contextlib.contextmanager
    def adapted(self, lora: LoRARequest | None) -> Iterator[None]:
        """The tower (images and videos alike) runs with `lora`'s tower weights inside
        (None: the base tower). ValueError when tower LoRA is off, or the adapter is bad."""
        if lora is None:
            yield
            return
        if self.lora is None and self.family_name is not None:
            raise ValueError(f"LoRA adapter {lora.lora_name!r}: it adapts {self.family_name}'s vision tower, which "
                             f"tower LoRA (--enable-tower-lora) does not cover yet")
        if self.lora is None:
            raise ValueError(f"LoRA adapter {lora.lora_name!r}: tower LoRA is not enabled on this encoder "
                             f"(--enable-tower-lora)")
        with self.lora.applied(lora):
            yield

    @torch.inference_mode()
    def encode(self, images: list[bytes], on_batch: BatchTimer | None = None,
               lora: LoRARequest | None = None, on_decode: DecodeTimer | None = None) -> list[MMEntry]:
        """Encodes raw images (raises encoders.image_io.ImageError on bad bytes).

        Batches are bounded by patches (the tower's work) and by decoded pixels
        (memory): an image is decoded only when its batch runs, so a request of
        several huge images never holds them all decoded at once. `on_batch`
        gets each tower batch's (images, preprocessing s, forward s). `lora`: the tower
        adapter every image runs with (`adapted`). `on_decode`: each image's
        (1, decode s) (its preprocessing time includes that)."""
        if self.vision is None:
            raise ImageError(NO_IMAGE_PROCESSOR)
        with self.adapted(lora):
            return self._encode(images, on_batch, on_decode)

    def _encode(self, images: list[bytes], on_batch: BatchTimer | None,
                on_decode: DecodeTimer | None) -> list[MMEntry]:
        out: list[MMEntry] = []
        batch: list[bytes] = []
        batch_patches = batch_pixels = 0
        for data in images:
            width, height = read_image_size(data, self.max_image_pixels)
            patches = self.vision.patches(width, height)
            if batch and (batch_patches + patches > self.max_batch_patches
                          or batch_pixels + width * height > self.max_decoded_pixels):
                out += self._run(batch, on_batch, on_decode)
                batch, batch_patches, batch_pixels = [], 0, 0
            batch.append(data)
            batch_patches += patches
            batch_pixels += width * height
        if batch:
            out += self._run(batch, on_batch, on_decode)
        return out

    def _run(self, images: list[bytes], on_batch: BatchTimer | None, on_decode: DecodeTimer | None) -> list[MMEntry]:
        start = time.perf_counter()
        inputs, metas = self.vision.preprocess([self._load(data, on_decode) for data in images])
        preprocessed = time.perf_counter()
        entries = self.vision.forward(inputs, metas)
        if on_batch is not None:
            if self.device.startswith("cuda"):
                torch.cuda.synchronize(self.device)  # the forward's time, not its launch's
            on_batch(len(images), preprocessed - start, time.perf_counter() - preprocessed)
        return entries

    def _load(self, data: bytes, on_decode: DecodeTimer | None):
        start = time.perf_counter()
        image = load_image(data, self.max_image_pixels)
        if on_decode is not None:
            on_decode(1, time.perf_counter() - start)
        return image
