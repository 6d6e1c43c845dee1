"""The test delays an encoder worker takes: read from the environment only at
the worker entry, none when unset."""
from __future__ import annotations

import pytest

from epd.encoders.encoder_delays import (ENV_BATCH_DELAY, ENV_CRASH_IMAGE, ENV_SLOW_IMAGE, ENV_VIDEO_DELAY,
                                         EncoderDelays)


def test_no_environment_means_no_delay():
    assert EncoderDelays.from_env({}) == EncoderDelays() == EncoderDelays(0.0, None, 0.0, 0.0, None, 0.0)


def test_the_environment_names_the_delays():
    delays = EncoderDelays.from_env({ENV_BATCH_DELAY: "1.5", ENV_SLOW_IMAGE: "72x56:4.0", ENV_VIDEO_DELAY: "3",
                                     ENV_CRASH_IMAGE: "40x24:2.5"})
    assert delays == EncoderDelays(batch_delay_s=1.5, slow_image_size=(72, 56), slow_image_s=4.0, video_delay_s=3.0,
                                   crash_image_size=(40, 24), crash_after_s=2.5)


def test_a_malformed_slow_image_is_refused():
    with pytest.raises(ValueError):
        EncoderDelays.from_env({ENV_SLOW_IMAGE: "72:4"})
    with pytest.raises(ValueError):
        EncoderDelays.from_env({ENV_CRASH_IMAGE: "40:1"})


def test_the_encoder_worker_reads_no_environment():
    from pathlib import Path

    import epd.encoders.encoder_worker as module

    assert "os.environ" not in Path(module.__file__).read_text()
