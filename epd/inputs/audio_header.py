"""An audio clip's samples as the encoder will hold them, counted in the API process:
`read_audio_samples`.

The API reads the stream's duration from the header first (PyAV container
metadata, as video_header.py reads a video's) and refuses a clip past
--max-audio-seconds before decoding anything. It then decodes and resamples
the clip exactly as the encoder does (transport/media/audio_samples.py), because
libswresample's output length follows no closed rule of the input's length
and rate: the count, and with it the family's `num_audio_tokens`, is the
encoder's by construction. Only the count leaves this process: the encoder
receives the file's bytes (docs/decisions/audio-items.md). Torch-free.
"""
from __future__ import annotations

import io
from fractions import Fraction

from epd.transport.media.audio_samples import decode_audio, resample


class AudioError(ValueError):
    """A clip the server cannot take (not audio, no duration, too long): a 400 naming why."""


def read_audio_samples(data: bytes, target_rate: int, max_seconds: float) -> int:
    """The clip's mono samples at `target_rate`; AudioError for a file with no audio stream,
    one that cannot be decoded, or one longer than `max_seconds` (--max-audio-seconds, read
    from the header when it gives the duration, else from the decoded samples)."""
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            stream = next((s for s in container.streams if s.type == "audio"), None)
            if stream is not None and stream.duration is not None and stream.time_base is not None:
                seconds = Fraction(stream.duration) * stream.time_base
                if seconds > max_seconds:
                    raise AudioError(_too_long(float(seconds), max_seconds))
    except av.FFmpegError as exc:
        raise AudioError(f"the audio file cannot be read ({exc})") from None
    try:
        samples, rate = decode_audio(data)
    except ValueError as exc:
        raise AudioError(str(exc)) from None
    if len(samples) > max_seconds * rate:
        raise AudioError(_too_long(len(samples) / rate, max_seconds))
    return len(resample(samples, rate, target_rate))


def _too_long(seconds: float, max_seconds: float) -> str:
    return f"the audio clip lasts {seconds:.1f} s; the limit is {max_seconds:g} s (--max-audio-seconds)"
