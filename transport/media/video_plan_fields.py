"""A video's plan as an EncodeRequest's fields: the `VideoPlan`
(transport/media/video_geometry.py) the API counted tokens for, the frames it
sampled, the size it resized them to and how its placeholders are laid out. An EncodeRequest carries it beside the
video's bytes, so the encoder decodes exactly what the API counted and never
plans again (planning needs the request's settings, which stay at the API).

`frame_indices` index the decoded stream (non-decreasing: the last frame may
repeat), each frame resized to `resized_height` x `resized_width`, giving the
vision grid `grid_thw` in patches (t: temporal groups) and `num_tokens`
placeholders, `tokens_per_group` a group; Qwen3-VL's `group_timestamps_s` (one
per group) or Qwen2.5-VL's `second_per_grid_t`. A chunk of a longer video
(`--video-chunk-frames`) names its first temporal group in the video and the
video's groups (`total_groups`; 0: the whole video), sent only when set."""
from __future__ import annotations

import math

from epd.transport.media.video_geometry import VideoPlan
from epd.transport.wire.codec import Fields, WireError

MAX_WIRE_FRAMES = 1 << 16  # frames one EncodeRequest may name
_KEYS = ("frame_indices", "resized_height", "resized_width", "grid_thw", "num_tokens", "tokens_per_group",
         "group_timestamps_s", "second_per_grid_t", "first_group", "total_groups")


def video_to_map(plan: VideoPlan) -> dict:
    """The plan's wire fields (a chunk's first_group and total_groups only when it is one)."""
    return {"frame_indices": list(plan.frame_indices), "resized_height": plan.resized_height,
            "resized_width": plan.resized_width, "grid_thw": list(plan.grid_thw), "num_tokens": plan.num_tokens,
            "tokens_per_group": plan.tokens_per_group, "group_timestamps_s": list(plan.group_timestamps_s),
            "second_per_grid_t": plan.second_per_grid_t,
            **({"first_group": plan.first_group, "total_groups": plan.total_groups} if plan.total_groups else {})}


def video_from_fields(f: Fields) -> VideoPlan:
    """The inverse of `video_to_map`; WireError naming the field for anything else."""
    f.reject_unknown(_KEYS)
    indices = f.list_of("frame_indices", int)
    height, width, grid = f.int("resized_height"), f.int("resized_width"), f.grid("grid_thw")
    num_tokens, per_group = f.int("num_tokens"), f.int("tokens_per_group")
    stamps = f.list_of("group_timestamps_s", float) if f.header.get("group_timestamps_s") else []
    second = f.float("second_per_grid_t")
    is_chunk = "first_group" in f.header or "total_groups" in f.header  # both or neither
    first, total = (f.int("first_group"), f.int("total_groups")) if is_chunk else (0, 0)
    if not 1 <= len(indices) <= MAX_WIRE_FRAMES or indices[0] < 0 \
            or any(b < a for a, b in zip(indices, indices[1:])):
        raise WireError(f"{f.tag}.frame_indices: 1 to {MAX_WIRE_FRAMES} non-decreasing frame numbers >= 0")
    if height < 1 or width < 1 or grid is None or min(grid) < 1 or grid[0] > len(indices):
        raise WireError(f"{f.tag}: size {height}x{width} with grid {grid} is not a video's")
    if height % grid[1] or width % grid[2] or height // grid[1] != width // grid[2]:
        raise WireError(f"{f.tag}: grid {grid} does not tile {height}x{width} in square patches")
    if per_group < 1 or num_tokens != grid[0] * per_group:
        raise WireError(f"{f.tag}: {num_tokens} tokens are not {grid[0]} groups of {per_group}")
    if stamps and (len(stamps) != grid[0] or not all(math.isfinite(s) and s >= 0 for s in stamps)):
        raise WireError(f"{f.tag}.group_timestamps_s: one finite time >= 0 per temporal group")
    if not (math.isfinite(second) and second >= 0):
        raise WireError(f"{f.tag}.second_per_grid_t: a finite number >= 0")
    if is_chunk and not (0 <= first and first + grid[0] <= total and grid[0] < total):
        raise WireError(f"{f.tag}: groups {first}..{first + grid[0]} are not a chunk of {total} groups")
    return VideoPlan(tuple(indices), height, width, grid, num_tokens, per_group, tuple(stamps), second,
                     first, total)
