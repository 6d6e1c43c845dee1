"""The test delays an encoder worker of a test's server takes (tests/testkit/encoder_delays.py):
read from the environment by the test subclass only, none when unset, and reaching the
server's processes through its PYTHONPATH, never through the product."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.encoder_delays import (ENV_BATCH_DELAY, ENV_CRASH_IMAGE, ENV_SLOW_IMAGE, ENV_VIDEO_DELAY,
                                    EncoderDelays, with_delay_site)

ROOT = Path(__file__).resolve().parents[3]


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
    import epd.encoders.encoder_worker as module

    assert "os.environ" not in Path(module.__file__).read_text()


def test_the_product_names_no_test_delay():
    product = [p for folder in ("epd", "engine", "encoders", "transport") for p in (ROOT / folder).rglob("*.py")]
    assert len(product) > 100
    named = [str(p.relative_to(ROOT)) for p in product if "EPD_TEST_" in (text := p.read_text())
             or "encoder_delays" in text or "testkit" in text]
    assert named == []


@pytest.mark.parametrize("asks", [False, True])
def test_a_server_environment_that_asks_gets_the_delayed_worker(asks):
    """The class a worker process builds, as the worker entry imports it."""
    env = with_delay_site({**os.environ, **({ENV_BATCH_DELAY: "0.5"} if asks else {})})
    assert ("PYTHONPATH" in env and env["PYTHONPATH"].startswith(str(ROOT / "tests/testkit/delay_site"))) == asks
    code = ("from epd.encoders.encoder_worker import EncoderWorker; "
            "print(EncoderWorker.__name__, EncoderWorker.__mro__[1].__name__)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == (["DelayedEncoderWorker", "EncoderWorker"] if asks else ["EncoderWorker", "WorkerIO"])
