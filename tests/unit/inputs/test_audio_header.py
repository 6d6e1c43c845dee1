"""The API's count of a clip's samples (epd/inputs/audio_header.py) is what the encoder's audio
side holds after decoding and resampling it, at rates where no closed rule of the length and
rate gives libswresample's output length; a clip past --max-audio-seconds and a file that is
not audio are refused by name."""
from __future__ import annotations

import io
import wave

import numpy as np
import pytest

from epd.inputs.audio_header import AudioError, read_audio_samples
from epd.transport.media.audio_samples import decode_audio, resample

pytest.importorskip("av")


def _wav(num_samples: int, rate: int) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.random.default_rng(num_samples).standard_normal(2 * num_samples) * 3000)
                      .astype(np.int16).tobytes())
    return out.getvalue()


@pytest.mark.parametrize("rate, num_samples", [(16000, 12345), (44100, 100), (48000, 132307), (22050, 19999),
                                               (8000, 4001)])
def test_the_count_is_the_encoders(rate, num_samples):
    data = _wav(num_samples, rate)
    samples, decoded_rate = decode_audio(data)
    assert decoded_rate == rate and samples.ndim == 1 and len(samples) == num_samples  # stereo made mono
    assert read_audio_samples(data, 16000, max_seconds=60) == len(resample(samples, rate, 16000))


def test_a_long_clip_and_a_non_audio_file_are_refused_by_name():
    with pytest.raises(AudioError, match=r"lasts 3\.0 s; the limit is 2 s \(--max-audio-seconds\)"):
        read_audio_samples(_wav(3 * 16000, 16000), 16000, max_seconds=2)
    with pytest.raises(AudioError, match="cannot be"):
        read_audio_samples(b"RIFF\0\0\0\0WAVEnot a wave", 16000, max_seconds=2)
