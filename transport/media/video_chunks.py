"""One long video's plan cut into chunks of whole temporal groups, each encoded
on its own (`--video-chunk-frames`): `split_plan`.

A plan's temporal groups are independent tower inputs (attention stays within
a group, encoders/video_encoder.py), so a chunk of groups [g0, g0 + n) encodes
to the very rows those groups get in the whole video. A chunk is a `VideoPlan`
of its own: its frames (`frame_indices[g0 * tps : (g0 + n) * tps]`, the last
chunk's last group filled by repeating its last frame as for the whole video),
grid (n, h, w), n groups' tokens and timestamps, `first_group` g0 and
`total_groups` the video's t. The API sends each chunk as its own
EncodeRequest, so several encoders take one video at once and the prefill
worker computes past the first chunk while the others encode.

Keys (transport/media/video_keys.py): a Qwen3-VL chunk's entries are its groups'
(`group_mm_hash(video, g)`, the same however the video is cut); a
Qwen2.5-VL chunk is one entry keyed by the video and its group range, and one
span of its own in the prompt (`MMSpan.first_group` keeps its M-RoPE temporal
positions those of the whole video). Torch-free.
"""
from __future__ import annotations

from dataclasses import replace

from epd.transport.media.video_geometry import VideoPlan


def groups_per_chunk(chunk_frames: int, temporal_patch_size: int) -> int:
    """Temporal groups in a chunk of `chunk_frames` sampled frames (rounded down, one at least); 0: no split."""
    return 0 if chunk_frames <= 0 else max(1, chunk_frames // temporal_patch_size)


def split_plan(plan: VideoPlan, temporal_patch_size: int, chunk_frames: int) -> list[VideoPlan]:
    """`plan` cut into chunks of `chunk_frames` sampled frames (whole temporal groups),
    in order; `[plan]` when it fits in one chunk or `chunk_frames` is 0."""
    t, h, w = plan.grid_thw
    per_chunk = groups_per_chunk(chunk_frames, temporal_patch_size)
    assert not plan.is_chunk, "a chunk is not cut again"
    if per_chunk == 0 or t <= per_chunk:
        return [plan]
    tps = temporal_patch_size
    chunks = []
    for first in range(0, t, per_chunk):
        n = min(per_chunk, t - first)
        chunks.append(replace(
            plan, frame_indices=plan.frame_indices[first * tps:(first + n) * tps], grid_thw=(n, h, w),
            num_tokens=n * plan.tokens_per_group, group_timestamps_s=plan.group_timestamps_s[first:first + n],
            first_group=first, total_groups=t))
    return chunks
