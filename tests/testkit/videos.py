"""Small real videos made in the tests with PyAV (nothing is downloaded)."""
from __future__ import annotations

import io
import os
import struct
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


def _box(data: bytes, path: list[bytes]) -> tuple[int, int]:
    """(start, end) of the payload of the mp4 box at `path` (b"moov", b"trak", ...)."""
    start, end = 0, len(data)
    for name in path:
        i = start
        while i + 8 <= end:
            size, kind = struct.unpack(">I4s", data[i:i + 8])
            if kind == name:
                start, end = i + 8, i + size
                break
            i += size
        else:
            raise KeyError(name)
    return start, end


def claims_hours(hours: float = 10, fps: int = 30) -> bytes:
    """A tiny mp4 (9 real frames) whose header claims `hours` of video at `fps`: its
    sample table counts hours x 3600 x fps frames and its durations say as much. Only
    decoding finds out; the header alone says "ten hours"."""
    data = bytearray(encode_video(synthetic_frames(9, 48, 64), "mp4", fps=fps))
    stbl = [b"moov", b"trak", b"mdia", b"minf", b"stbl"]
    start, _ = _box(data, [*stbl, b"stts"])  # version+flags, entry count, (sample count, sample delta)...
    num_entries = struct.unpack_from(">I", data, start + 4)[0]
    entries = [struct.unpack_from(">II", data, start + 8 + 8 * k) for k in range(num_entries)]
    total = int(hours * 3600 * fps)
    struct.pack_into(">I", data, start + 8, total - sum(count for count, _ in entries[1:]))
    delta = entries[0][1]
    mdhd, _ = _box(data, [b"moov", b"trak", b"mdia", b"mdhd"])  # version 0: flags, ctime, mtime, timescale, duration
    struct.pack_into(">I", data, mdhd + 16, total * delta)
    mvhd, _ = _box(data, [b"moov", b"mvhd"])
    movie_scale = struct.unpack_from(">I", data, mvhd + 12)[0]
    struct.pack_into(">I", data, mvhd + 16, int(hours * 3600 * movie_scale))
    elst, _ = _box(data, [b"moov", b"trak", b"edts", b"elst"])  # version 0: flags, count, (duration, time, rate)
    struct.pack_into(">I", data, elst + 8, int(hours * 3600 * movie_scale))
    return bytes(data)


def claims_size(width: int = 10000, height: int = 10000) -> bytes:
    """A lossless mkv of two 256x256 frames whose track header says `width` x `height`
    (Matroska's PixelWidth/PixelHeight, which FFV1 takes from the container)."""
    data = encode_video(synthetic_frames(2, 256, 256), "mkv", fps=5)
    for element, value in ((0xB0, width), (0xBA, height)):  # 2-byte values, in place
        old = bytes([element, 0x82]) + struct.pack(">H", 256)
        assert data.count(old) == 1, element
        data = data.replace(old, bytes([element, 0x82]) + struct.pack(">H", value))
    return data


def gif_frames(num_frames: int, delay_cs: int = 4) -> bytes:
    """An animated GIF of `num_frames` 1x1 frames, written byte by byte (Pillow would
    merge identical frames): a few megabytes hold millions of them."""
    head = b"GIF89a" + struct.pack("<HHBBB", 1, 1, 0x80, 0, 0) + b"\x00\x00\x00\xff\xff\xff"  # 2-colour palette
    frame = (b"\x21\xf9\x04\x00" + struct.pack("<H", delay_cs) + b"\x00\x00"  # graphic control: the delay
             + b"\x2c" + struct.pack("<HHHH", 0, 0, 1, 1) + b"\x00"  # image descriptor, 1x1
             + b"\x02\x02\x44\x01\x00")  # LZW (min code size 2): clear, pixel 0, end
    return head + frame * num_frames + b"\x3b"
