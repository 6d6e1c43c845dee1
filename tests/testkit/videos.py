"""Small real videos made in the tests with PyAV (nothing is downloaded)."""
from __future__ import annotations

import io
import os
import tempfile

import numpy as np

# (container format, codec, pixel format): lossy mp4, lossless Matroska (whose
# header keeps no frame count), VP9 WebM
VIDEO_KINDS = {
    "mp4": ("mp4", "mpeg4", "yuv420p"),
    "mkv": ("matroska", "ffv1", "bgr0"),
    "webm": ("webm", "libvpx-vp9", "yuv420p"),
}


def synthetic_frames(num_frames: int, height: int = 48, width: int = 64, seed: int = 0) -> np.ndarray:
    """uint8 [num_frames, height, width, 3]: a moving gradient plus noise, unlike frame to frame."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    frames = [np.stack([(x * 4 + i * 23) % 256, (y * 5 + i * 41) % 256, (x + y + i * 67) % 256], axis=-1)
              for i in range(num_frames)]
    noise = rng.integers(0, 24, (num_frames, height, width, 3))
    return ((np.stack(frames) + noise) % 256).astype(np.uint8)


def encode_video(frames: np.ndarray, kind: str = "mp4", fps: int = 5) -> bytes:
    """The frames encoded as one video stream at `fps` frames per second."""
    import av

    fmt, codec, pix_fmt = VIDEO_KINDS[kind]
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = pix_fmt
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return buf.getvalue()


def audio_only(seconds: float = 0.25, rate: int = 8000) -> bytes:
    """A WAV file: a container with an audio stream and no video stream."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="wav") as container:
        stream = container.add_stream("pcm_s16le", rate=rate)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, int(rate * seconds)), np.int16), format="s16", layout="mono")
        frame.sample_rate = rate
        for packet in (*stream.encode(frame), *stream.encode()):
            container.mux(packet)
    return buf.getvalue()


def cut_after_header(frames: np.ndarray, fps: int = 5, keep: float = 2 / 3) -> bytes:
    """An mp4 with its index first (faststart) cut short: the header promises every
    frame, the data holds the first `keep` of the file, so only decoding finds out."""
    import av

    fd, path = tempfile.mkstemp(suffix=".mp4")  # faststart rewrites the file: it needs a path
    os.close(fd)
    try:
        with av.open(path, "w", format="mp4", options={"movflags": "faststart"}) as container:
            stream = container.add_stream("mpeg4", rate=fps)
            stream.height, stream.width = frames.shape[1:3]
            stream.pix_fmt = "yuv420p"
            for frame in frames:
                container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
            container.mux(stream.encode())
        with open(path, "rb") as f:
            data = f.read()
    finally:
        os.unlink(path)
    return data[: int(len(data) * keep)]
