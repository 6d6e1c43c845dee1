"""A video's placeholder tokens from its container header (API process).

The API process never decodes a video's pixels: it reads the header (frame
count, average rate, size; encoders/video_io.py), lets the checkpoint's video
processor rules choose the sampled frames and their size
(encoders/video_geometry.py) and counts the tokens. The resulting `VideoPlan`
is what the encoder decodes and preprocesses, so both sides agree by
construction. Torch-free.
"""
from __future__ import annotations

from epd.encoders.video_geometry import VideoGeometry, VideoMeta, VideoOptions, VideoPlan, VideoPlanError
from epd.encoders.video_io import VideoError, read_video_meta

__all__ = ["VideoError", "VideoMeta", "VideoOptions", "VideoPlan", "plan_video"]


def plan_video(data: bytes, geometry: VideoGeometry, options: VideoOptions = VideoOptions(),
               max_frames: int | None = None) -> tuple[VideoMeta, VideoPlan]:
    """(header, plan) of one video; VideoError for anything a client must be
    told (not a video, no frames, settings the processor refuses, more than
    `max_frames` frames in the container)."""
    meta = read_video_meta(data)
    if max_frames is not None and meta.num_frames > max_frames:
        raise VideoError(f"the video has {meta.num_frames} frames; the limit is {max_frames}")
    try:
        return meta, geometry.plan(meta, options)
    except VideoPlanError as exc:
        raise VideoError(str(exc)) from None
