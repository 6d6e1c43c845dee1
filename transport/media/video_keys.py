"""A video's content keys: the mm_hash of the video, and those of the entries
its placeholder spans name.

Both sides derive them the same way: the API when it writes the prompt's spans
(epd/inputs/prompt.py), the encoder when it stores what it encoded
(encoders/video_encoder.py), so the engine finds each span's rows by key.

A plan with timestamps (Qwen3-VL, GLM-4.1V, InternVL) has text between its
temporal groups (Qwen3-VL's `<t seconds><|vision_start|>` ... `<|vision_end|>`,
GLM-4.1V's times, InternVL's frame labels), so each group is its own
placeholder run, span and entry, keyed by `group_mm_hash`; its M-RoPE
positions are those of a one-frame grid (1, h, w), as transformers splits the
video's grid. A plan without (Qwen2.5-VL) is one run, one span, one entry of
grid (t, h, w); cut into chunks (transport/media/video_chunks.py), one span and one
entry per chunk, keyed by `chunk_mm_hash` (its group range). Groups are independent tower inputs (attention stays within a
group), so a group's entry is the same whether it was encoded alone or with
the rest of its video. Torch-free at import (epd/inputs/prompt.py imports it).
"""
from __future__ import annotations

import hashlib

from epd.transport.media.video_geometry import VideoPlan


def video_mm_hash(data: bytes, model_fingerprint: str, video_config: dict, plan: VideoPlan) -> str:
    """Content key of one video as encoded: its bytes, the model, the video
    processor's settings and what the plan picked (frames and their size);
    the timestamps change the prompt, not the embeddings, and are left out."""
    from epd.transport.embedding_cache.mm_cache import mm_hash  # here: the prompt side imports this module, torch-free

    config = {**video_config, "epd_video_plan": {"frame_indices": list(plan.frame_indices),
                                                 "resized": [plan.resized_height, plan.resized_width]}}
    return mm_hash(data, model_fingerprint, config)


def group_mm_hash(video_hash: str, group: int) -> str:
    """Key of temporal group `group` of the video keyed `video_hash` (64 hex chars, as every mm_hash)."""
    return hashlib.blake2b(f"epd-video-group-v1:{video_hash}:{group}".encode(), digest_size=32).hexdigest()


def chunk_mm_hash(video_hash: str, first_group: int, end_group: int) -> str:
    """Key of the one entry of temporal groups [first_group, end_group) of a video
    without timestamps (Qwen2.5-VL), cut into chunks (transport/media/video_chunks.py)."""
    return hashlib.blake2b(f"epd-video-chunk-v1:{video_hash}:{first_group}:{end_group}".encode(),
                           digest_size=32).hexdigest()


def entry_hashes(video_hash: str, plan: VideoPlan) -> list[str]:
    """The keys of the entries the video's spans name, in prompt order: one
    per temporal group where the plan writes timestamps, else the video's own
    (a chunk's: its group range's). `plan` may be a chunk of the video's plan."""
    first, t = plan.first_group, plan.grid_thw[0]
    if plan.group_timestamps_s:
        return [group_mm_hash(video_hash, g) for g in range(first, first + t)]
    return [chunk_mm_hash(video_hash, first, first + t) if plan.is_chunk else video_hash]
