"""The video limit flags `epd serve` and `epd worker` share, defined once: what one
video may be (encoded size, container frames) and what decoding it may cost an
encoder (decoded pixels, seconds). The API checks them from the header, the
encoder again on the real stream (epd/inputs/media.py MediaConfig.decode_limits)."""
from __future__ import annotations

import argparse

from epd.config import field_default
from epd.inputs.media import MediaConfig

VIDEO_LIMITS = ("max_video_bytes", "max_video_frames", "max_request_video_pixels", "video_decode_timeout_s")


def add_video_limit_args(p: argparse.ArgumentParser) -> None:
    video = {name: field_default(MediaConfig, name) for name in VIDEO_LIMITS}
    p.add_argument("--max-video-mb", type=float, default=video["max_video_bytes"] / (1 << 20),
                   help="refuse larger encoded videos")
    p.add_argument("--max-video-frames", type=int, default=video["max_video_frames"],
                   help="refuse a video whose container holds more frames (from its header)")
    p.add_argument("--max-request-video-pixels", type=int, default=video["max_request_video_pixels"],
                   help="pixels the encoder may decode for one request's videos (every frame up to the last "
                        "sampled one, full size; from the headers)")
    p.add_argument("--video-decode-timeout", type=float, default=video["video_decode_timeout_s"],
                   help="seconds an encoder may take to decode one video; then its request fails")


def video_limits(args) -> dict:
    """The MediaConfig fields of parsed video limit flags (VIDEO_LIMITS -> value)."""
    return {"max_video_bytes": int(args.max_video_mb * (1 << 20)), "max_video_frames": args.max_video_frames,
            "max_request_video_pixels": args.max_request_video_pixels,
            "video_decode_timeout_s": args.video_decode_timeout}
