"""An audio file's bytes -> mono float32 samples, and resampling: `decode_audio`, `resample` (PyAV).

One decoding for both sides of a served clip: the API counts a clip's samples
with it (epd/inputs/audio_header.py) and the encoder decodes the clip it
encodes with it (encoders/audio_encoder.py, the family's audio side), so the
placeholder count and the embeddings' rows agree by construction.
Torch-free.
"""
from __future__ import annotations

import io

import numpy as np


def decode_audio(data: bytes) -> tuple[np.ndarray, int]:
    """An audio file's bytes -> (mono float32 samples, sampling rate); ValueError naming what failed."""
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            stream = next((s for s in container.streams if s.type == "audio"), None)
            if stream is None:
                raise ValueError("the audio file holds no audio stream")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=stream.rate)
            chunks = [f.to_ndarray()[0] for frame in container.decode(stream) for f in resampler.resample(frame)]
            chunks += [f.to_ndarray()[0] for f in resampler.resample(None)]
            rate = stream.rate
    except av.FFmpegError as exc:
        raise ValueError(f"the audio file cannot be decoded ({exc})") from None
    if not chunks:
        raise ValueError("the audio file holds no samples")
    return np.concatenate(chunks).astype(np.float32, copy=False), int(rate)


def resample(samples: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Mono float32 samples at `rate` -> at `target` (band-limited, PyAV's libswresample)."""
    if rate == target:
        return samples
    import av

    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples, dtype=np.float32)[None, :], format="flt",
                                       layout="mono")
    frame.sample_rate = rate
    resampler = av.AudioResampler(format="flt", layout="mono", rate=target)
    out = [f.to_ndarray()[0] for f in (*resampler.resample(frame), *resampler.resample(None))]
    return np.concatenate(out) if out else np.zeros(0, np.float32)
