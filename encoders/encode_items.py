"""A batch of images under their tower adapters: `encode_items`.

One tower forward runs one adapter's weights (or none), so a batch is split
by adapter and each group encoded under its own (ImageEncoder.adapted). The
encoder worker (encoders/encoder_worker.py), the aggregated worker's
in-process encoder (epd/processes/worker_entry.py) and the offline LLM
(epd/llm.py) all encode their images through it.
"""
from __future__ import annotations

from epd.encoders.image_encoder import BatchTimer, DecodeTimer, ImageEncoder
from epd.encoders.image_io import ImageError
from epd.transport.embedding_cache.mm_entry import MMEntry
from epd.transport.wire.lora_request import LoRARequest


def encode_items(encoder: ImageEncoder, images: list[bytes], loras: list[LoRARequest | None],
                 on_batch: BatchTimer | None = None, on_decode: DecodeTimer | None = None
                 ) -> list[MMEntry | ValueError]:
    """Each image's entry, or the error it fails with, in the images' order; `loras[i]`
    is image i's tower adapter (None: the base tower). A group holding a bad image is
    encoded again one by one (its ImageError for the bad ones); a bad adapter, or tower
    LoRA off, fails its whole group (the adapter's ValueError)."""
    groups: dict[LoRARequest | None, list[int]] = {}
    for index, lora in enumerate(loras):
        groups.setdefault(lora, []).append(index)
    results: list[MMEntry | ValueError] = [None] * len(images)
    for lora, indices in groups.items():
        entries = _encode_group(encoder, [images[i] for i in indices], lora, on_batch, on_decode)
        for index, entry in zip(indices, entries):
            results[index] = entry
    return results


def _encode_group(encoder: ImageEncoder, images: list[bytes], lora: LoRARequest | None,
                  on_batch: BatchTimer | None, on_decode: DecodeTimer | None) -> list[MMEntry | ValueError]:
    try:
        with encoder.adapted(lora):
            try:
                return encoder.encode(images, on_batch=on_batch, on_decode=on_decode)
            except ImageError:  # find the bad one(s)
                out = []
                for image in images:
                    try:
                        out.append(encoder.encode([image], on_batch=on_batch, on_decode=on_decode)[0])
                    except ImageError as exc:
                        out.append(exc)
                return out
    except ValueError as exc:  # the adapter: unreadable, another base's, or tower LoRA off here
        return [exc] * len(images)
