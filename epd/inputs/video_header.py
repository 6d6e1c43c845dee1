"""A video's placeholder tokens from its container header (API process).

The API process never decodes a video's pixels: it reads the header (frame
count, average rate, size; encoders/video_io.py), lets the checkpoint's video
processor rules (its family's `VideoRules`, transport/media/prompt_format.py;
Qwen's transport/media/video_geometry.py) choose the sampled frames and their
size and counts the tokens. The resulting `VideoPlan`
is what the encoder decodes and preprocesses, so both sides agree by
construction. Torch-free.
"""
from __future__ import annotations

import numpy as np

from epd.transport.media.prompt_format import VideoRules
from epd.transport.media.video_geometry import (VideoKwargsError, VideoMeta, VideoOptions, VideoPlan,
                                                VideoPlanError)
from epd.encoders.video_io import TooManyFrames, VideoError, read_video_meta

__all__ = ["VideoError", "VideoKwargsRefused", "VideoMeta", "VideoOptions", "VideoPlan", "loader_frames", "plan_video"]


class VideoKwargsRefused(VideoError):
    """A request's mm_processor_kwargs past the video or the server's budget (a 400 naming them)."""


def plan_video(data: bytes, geometry: VideoRules, options: VideoOptions = VideoOptions(),
               max_frames: int | None = None, max_frame_pixels: int | None = None,
               loader_num_frames: int = -1, request: VideoOptions | None = None,
               server: VideoOptions = VideoOptions(), max_group_pixels: int | None = None
               ) -> tuple[VideoMeta, VideoPlan]:
    """(header, plan) of one video; VideoError for anything a client must be
    told (not a video, no frames, settings the processor refuses, more than
    `max_frames` frames in the container, frames of more than `max_frame_pixels`).
    `loader_num_frames` (--media-io-kwargs video.num_frames): see `loader_frames`.

    `request`: the request's own mm_processor_kwargs (inside `options`, which
    holds `server`'s beneath them), checked against the video and the server's
    budget before any planning (the rules' check_request); then a temporal
    group's frames may not hold more pixels than `max_group_pixels` (the image
    processor's budget per image) or than the server's own settings give this
    video, whichever is more: a request's kwargs never buy a larger group."""
    try:
        meta = read_video_meta(data, max_frames)  # a container that keeps no count: counted up to the limit
    except TooManyFrames as exc:
        raise VideoError(f"{exc}; the limit is {max_frames} (--max-video-frames)") from None
    if max_frames is not None and meta.num_frames > max_frames:
        raise VideoError(f"the video has {meta.num_frames} frames; the limit is {max_frames} (--max-video-frames)")
    if max_frame_pixels is not None and meta.width * meta.height > max_frame_pixels:
        raise VideoError(f"video frames of {meta.width}x{meta.height} exceed the limit of {max_frame_pixels} pixels")
    loaded = loader_frames(meta.num_frames, loader_num_frames)
    try:
        if request is not None:
            geometry.check_request(meta, request, server)
        plan = geometry.plan(meta, options, loaded)
        if request is not None and max_group_pixels is not None:
            _check_group(plan, geometry, meta, server, loaded, max_group_pixels)
    except VideoKwargsError as exc:
        raise VideoKwargsRefused(str(exc)) from None
    except VideoPlanError as exc:
        raise VideoError(str(exc)) from None
    except (ArithmeticError, ValueError) as exc:  # settings no rule foresaw: this request's fault, a 400
        raise VideoError(f"cannot plan the video with these settings ({exc.__class__.__name__})") from None
    return meta, plan


def _check_group(plan: VideoPlan, geometry: VideoRules, meta: VideoMeta, server: VideoOptions,
                 loaded: list[int] | None, max_group_pixels: int) -> None:
    pixels = plan.resized_height * plan.resized_width  # one frame of a temporal group
    if pixels <= max_group_pixels:
        return
    own = geometry.plan(meta, server, loaded)  # the server's settings alone: what any request gets
    if pixels > own.resized_height * own.resized_width:
        raise VideoKwargsError(f"they would resize the video's frames to {plan.resized_width}x"
                             f"{plan.resized_height}, past this server's limit of {max_group_pixels} pixels "
                             f"a frame (the image budget)")


def loader_frames(total: int, num_frames: int) -> list[int] | None:
    """vLLM's video loader with `num_frames` (its --media-io-kwargs): that many frames
    taken evenly, `np.linspace(0, total - 1, n, dtype=int)`, which the processor then
    samples no further; None (every frame, the processor samples) for -1 or when
    `num_frames` reaches the frame count (vLLM's loader reads them all then)."""
    if num_frames == -1 or total < 1 or min(num_frames, total) == total:
        return None
    return np.linspace(0, total - 1, num_frames, dtype=int).tolist()
