"""A video's placeholder tokens from its container header (API process).

The API process never decodes a video's pixels: it reads the header (frame
count, average rate, size; encoders/video_io.py), lets the checkpoint's video
processor rules choose the sampled frames and their size
(encoders/video_geometry.py) and counts the tokens. The resulting `VideoPlan`
is what the encoder decodes and preprocesses, so both sides agree by
construction. Torch-free.
"""
from __future__ import annotations

import numpy as np

from epd.encoders.video_geometry import VideoGeometry, VideoMeta, VideoOptions, VideoPlan, VideoPlanError
from epd.encoders.video_io import TooManyFrames, VideoError, read_video_meta

__all__ = ["VideoError", "VideoMeta", "VideoOptions", "VideoPlan", "loader_frames", "plan_video"]


def plan_video(data: bytes, geometry: VideoGeometry, options: VideoOptions = VideoOptions(),
               max_frames: int | None = None, max_frame_pixels: int | None = None,
               loader_num_frames: int = -1) -> tuple[VideoMeta, VideoPlan]:
    """(header, plan) of one video; VideoError for anything a client must be
    told (not a video, no frames, settings the processor refuses, more than
    `max_frames` frames in the container, frames of more than `max_frame_pixels`).
    `loader_num_frames` (--media-io-kwargs video.num_frames): see `loader_frames`."""
    try:
        meta = read_video_meta(data, max_frames)  # a container that keeps no count: counted up to the limit
    except TooManyFrames as exc:
        raise VideoError(f"{exc}; the limit is {max_frames} (--max-video-frames)") from None
    if max_frames is not None and meta.num_frames > max_frames:
        raise VideoError(f"the video has {meta.num_frames} frames; the limit is {max_frames} (--max-video-frames)")
    if max_frame_pixels is not None and meta.width * meta.height > max_frame_pixels:
        raise VideoError(f"video frames of {meta.width}x{meta.height} exceed the limit of {max_frame_pixels} pixels")
    try:
        return meta, geometry.plan(meta, options, loader_frames(meta.num_frames, loader_num_frames))
    except VideoPlanError as exc:
        raise VideoError(str(exc)) from None


def loader_frames(total: int, num_frames: int) -> list[int] | None:
    """vLLM's video loader with `num_frames` (its --media-io-kwargs): that many frames
    taken evenly, `np.linspace(0, total - 1, n, dtype=int)`, which the processor then
    samples no further; None (every frame, the processor samples) for -1 or when
    `num_frames` reaches the frame count (vLLM's loader reads them all then)."""
    if num_frames == -1 or total < 1 or min(num_frames, total) == total:
        return None
    return np.linspace(0, total - 1, num_frames, dtype=int).tolist()
