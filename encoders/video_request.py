"""One video EncodeRequest -> the (key, entry) pairs its spans wait for, or the
error its request fails with. Shared by the encoder worker
(encoders/encoder_worker.py) and the aggregated worker's in-process encoder
(epd/processes/worker_entry.py), so a video is decoded, limited and keyed the same
way whichever process encodes it.

    plan (the API's VideoPlan) -> decode_frames(bytes, plan.frame_indices, DecodeLimits,
                                                  each frame resized to the plan's size as decoded)
                                 -> VideoEncoder.encode_frames -> [(key, MMEntry)]
    a failure: [(first entry's key, "video: ...")]: the request waits for every
    entry, so failing the first fails it, and the worker serves on.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from epd.encoders.video_encoder import VideoEncoder
from epd.encoders.video_io import DecodeLimits, VideoError, decode_frames
from epd.transport.media.video_keys import entry_hashes
from epd.encoders.video_processor import frame_resizer
from epd.transport.wire.messages import EncodeRequest
from epd.transport.embedding_cache.mm_entry import MMEntry

log = logging.getLogger("epd.encoder")
NO_VIDEO_ENCODER = "this encoder serves no video (its checkpoint has no video processor config)"


def video_keys(msg: EncodeRequest) -> list[str]:
    """The cache keys a video EncodeRequest's entries are stored under, in prompt order."""
    assert msg.video is not None
    return entry_hashes(msg.mm_hash, msg.video)


def encode_video_request(video: VideoEncoder | None, msg: EncodeRequest, limits: DecodeLimits | None,
                         on_done: Callable[[float, float], None] | None = None,
                         on_decode: Callable[[int, float], None] | None = None) -> list[tuple[str, MMEntry | str]]:
    """The entries of the video `msg` carries, each under its own key; on failure one
    pair (its first key, an error fit for the client). `video` None: the checkpoint
    serves no video. `on_done(preprocess_s, forward_s)` as VideoEncoder.encode_frames';
    `on_decode(frames decoded, decode s)` once its frames are decoded: every frame up to
    the last planned one (FFmpeg decodes those it skips), as the decode limits count them."""
    first_key = video_keys(msg)[0]
    if video is None:
        return [(first_key, NO_VIDEO_ENCODER)]
    plan = msg.video  # the API's plan, as the EncodeRequest carried it (transport/media/video_plan_fields.py)
    try:
        start = time.perf_counter()
        if limits is not None:
            limits.check_resized(plan.resized_width, plan.resized_height, len(plan.frame_indices))
        resize = frame_resizer(plan.resized_height, plan.resized_width)  # held at the planned size
        frames = decode_frames(msg.image, plan.frame_indices, limits, resize)
        if on_decode is not None:
            on_decode(max(plan.frame_indices) + 1, time.perf_counter() - start)
        return list(video.encode_frames(frames, plan, msg.mm_hash, on_done=on_done))
    except VideoError as exc:  # the bytes, not the worker: this request fails, the worker serves on
        return [(first_key, f"video: {exc}")]
    except Exception as exc:  # a plan the frames do not fit, a tower error: this video only
        log.exception("video %s failed", msg.mm_hash[:12])
        return [(first_key, f"video: {exc.__class__.__name__}")]
