"""Reading videos with PyAV (the `video` extra): the container's header only
(API process: frame count, rate, size) or the planned frames' pixels (encoder).

PyAV rather than torchvision or torchcodec: it is a self-contained wheel (its
own FFmpeg inside), installs beside any torch build, reads the header without
decoding, and is the reader transformers itself uses (`read_video_pyav`): frame
count from the stream's `frames`, rate from its `average_rate`, pixels as rgb24.
Every failure is a `VideoError` with a message fit for a client.
"""
from __future__ import annotations

import io
import time
from collections.abc import Callable
from dataclasses import dataclass

from epd.transport.media.video_geometry import VideoMeta

FrameResize = Callable[["np.ndarray"], "np.ndarray"]  # noqa: F821  uint8 [H, W, 3] -> [h, w, 3]


@dataclass(frozen=True)
class DecodeLimits:
    """What decoding one video may cost the encoder (epd serve's video flags): the
    pixels of one frame, the pixels decoded in all (every frame up to the last
    sampled one, full size: FFmpeg decodes those it skips), and the seconds."""

    max_frame_pixels: int
    max_decoded_pixels: int
    deadline_s: float

    def check_size(self, width: int, height: int, last_index: int) -> None:
        """VideoError when frames of this size, decoded up to `last_index`, are past the limits."""
        if width * height > self.max_frame_pixels:
            raise VideoError(f"video frames of {width}x{height} exceed the limit of {self.max_frame_pixels} pixels")
        if (last_index + 1) * width * height > self.max_decoded_pixels:
            raise VideoError(f"decoding {last_index + 1} frames of {width}x{height} exceeds the limit of "
                             f"{self.max_decoded_pixels} decoded pixels")


    def check_resized(self, width: int, height: int, num_frames: int) -> None:
        """VideoError when a plan's frames at their planned size hold more pixels than may
        be decoded (a plan forged by a peer: the encoder holds them all at that size)."""
        if num_frames * width * height > self.max_decoded_pixels:
            raise VideoError(f"a plan of {num_frames} frames resized to {width}x{height} exceeds the limit of "
                             f"{self.max_decoded_pixels} decoded pixels")


class VideoError(ValueError):
    """The bytes are not a usable video."""


def _av():
    try:
        import av
    except ImportError:
        raise VideoError("video input needs PyAV: pip install 'epd[video]'") from None
    return av


def _open(data: bytes):
    av = _av()
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except Exception as exc:  # av raises InvalidDataError and others for bad input
        raise VideoError(f"cannot open video: {exc.__class__.__name__}") from None
    if not container.streams.video:
        container.close()
        raise VideoError("the file has no video stream")
    return container


class TooManyFrames(VideoError):
    """The container holds more frames than the caller's limit (counted without decoding)."""


def read_video_meta(data: bytes, max_frames: int | None = None) -> VideoMeta:
    """The first video stream's frame count, average rate and size, as
    transformers' PyAV reader takes them; no frame is decoded. A header that
    counts no frames (Matroska/WebM keep no count) is counted by demuxing the
    stream's packets, which reads the file but decodes nothing, and stops with
    TooManyFrames past `max_frames` (tiny frames pack millions into a few
    megabytes)."""
    container = _open(data)
    try:
        stream = container.streams.video[0]
        num_frames = int(stream.frames)
        fps = float(stream.average_rate) if stream.average_rate else 0.0
        width, height = int(stream.codec_context.width), int(stream.codec_context.height)
        if num_frames == 0:
            num_frames = _count_packets(container, stream, max_frames)
    except VideoError:
        raise
    except Exception as exc:
        raise VideoError(f"cannot read video header: {exc.__class__.__name__}") from None
    finally:
        container.close()
    return VideoMeta(num_frames=num_frames, fps=fps, width=width, height=height)


def _count_packets(container, stream, max_frames: int | None) -> int:
    count = 0
    for packet in container.demux(stream):
        count += packet.size > 0
        if max_frames is not None and count > max_frames:
            raise TooManyFrames(f"the video has more than {max_frames} frames")
    return count


def decode_frames(data: bytes, frame_indices: tuple[int, ...] | list[int],
                  limits: DecodeLimits | None = None, resize: FrameResize | None = None) -> "np.ndarray":  # noqa: F821
    """The frames at `frame_indices` (ascending, repeats allowed) of the first
    video stream, as uint8 [num_frames, height, width, 3] RGB, decoding no further
    than the last one. VideoError when the stream ends before it, or (`limits`)
    its frames are too large or it takes longer than the deadline.

    `resize`: applied to each kept frame as it is decoded (uint8 [H, W, 3] ->
    [h, w, 3]), so what is held is the planned frames at their planned size plus
    one full-size frame, never every sampled frame at full size (4,096 1080p
    frames are 25 GB)."""
    import numpy as np

    if not frame_indices:
        raise VideoError("no frame to decode")
    slots: dict[int, list[int]] = {}  # stream index -> its positions in the output (repeats)
    for position, index in enumerate(frame_indices):
        slots.setdefault(index, []).append(position)
    last = max(slots)
    out = None  # [num_frames, h, w, 3], allocated at the first kept frame
    size = None  # (width, height) of the first kept frame
    container = _open(data)
    start = time.monotonic()
    try:
        if limits is not None:
            context = container.streams.video[0].codec_context
            limits.check_size(int(context.width), int(context.height), last)
        for i, frame in enumerate(container.decode(video=0)):
            if limits is not None and time.monotonic() - start > limits.deadline_s:
                raise VideoError(f"decoding the video took more than {limits.deadline_s:g} s")
            if i in slots:
                if limits is not None:  # the stream's size may change midway: each kept frame is checked
                    limits.check_size(frame.width, frame.height, last)
                if size is not None and size != (frame.width, frame.height):
                    raise VideoError("the video's frame size changes midway")
                size = (frame.width, frame.height)
                pixels = frame.to_ndarray(format="rgb24")
                if resize is not None:
                    pixels = resize(pixels)
                if out is None:
                    out = np.empty((len(frame_indices), *pixels.shape), np.uint8)
                out[slots[i]] = pixels
            if i >= last:
                break
    except VideoError:
        raise
    except Exception as exc:
        raise VideoError(f"cannot decode video: {exc.__class__.__name__}") from None
    finally:
        container.close()
    if out is None or i < last:
        raise VideoError(f"the video ends before frame {last} (its header promised more)")
    return out
