"""Delays and one fault an encoder worker of a test's server can be told to add, for
tests that need an encoder slower than the machine makes it:

    batch_delay_s     every batch (a video or video chunk too) takes at least this
                      many seconds more, so a burst backs the queue up whatever the
                      machine's speed (the autoscaling and heartbeat tests), or an
                      encoder can be killed mid-video (the video chunk tests)
    slow_image_size   (width, height): the EncodeDone of every image of that
    slow_image_s      size is held back that long, without blocking the worker,
                      so an image arrives late, after the request's later
                      images, whichever encoder it was routed to (early prefill)
    video_delay_s     every video's encode takes this many seconds more (the worker
                      is busy in it), announced by a warning in the log, so a
                      test can kill the encoder in the middle of a video's encode
    crash_image_size  (width, height): a batch holding an image of that size kills
    crash_after_s     its encoder (SIGKILL to itself, that many seconds into the batch,
                      as the kernel's OOM killer ends a process whose memory grew),
                      announced by a warning in the log: a poison input (the
                      poison-request tests)

A test asks for them in the environment of the server it starts (`ENV_BATCH_DELAY`,
`ENV_SLOW_IMAGE` = "WxH:SECONDS", `ENV_VIDEO_DELAY`, `ENV_CRASH_IMAGE` = "WxH:SECONDS");
`testkit.server.ServerProcess` then puts `DELAY_SITE` on the server's PYTHONPATH, whose
sitecustomize.py makes every encoder worker of every process of that server (spawned,
`epd worker`, a Ray actor) a `testkit.delayed_encoder.DelayedEncoderWorker`. The product
knows nothing of them (docs/decisions/test-delays.md).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ENV_BATCH_DELAY = "EPD_TEST_ENCODER_BATCH_DELAY_S"
ENV_SLOW_IMAGE = "EPD_TEST_SLOW_IMAGE"
ENV_VIDEO_DELAY = "EPD_TEST_VIDEO_DELAY_S"
ENV_CRASH_IMAGE = "EPD_TEST_ENCODER_CRASH_IMAGE"
VIDEO_DELAY_LOG = "test delay: encoding video"  # the warning a delayed video's encode starts with
CRASH_LOG = "test fault: this batch kills the encoder"  # the warning before a poison image's crash
DELAY_SITE = str(Path(__file__).resolve().parent / "delay_site")  # holds the servers' sitecustomize.py


@dataclass(frozen=True)
class EncoderDelays:
    batch_delay_s: float = 0.0
    slow_image_size: tuple[int, int] | None = None  # (width, height)
    slow_image_s: float = 0.0
    video_delay_s: float = 0.0
    crash_image_size: tuple[int, int] | None = None  # (width, height)
    crash_after_s: float = 0.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> EncoderDelays:
        """The delays `environ` asks for (none when it names none)."""
        size, seconds = None, 0.0
        if value := environ.get(ENV_SLOW_IMAGE):
            dims, _, held = value.partition(":")
            size, seconds = _size(dims), float(held)
        crash, crash_s = None, 0.0
        if value := environ.get(ENV_CRASH_IMAGE):
            dims, _, after = value.partition(":")
            crash, crash_s = _size(dims), float(after)
        return cls(float(environ.get(ENV_BATCH_DELAY) or 0.0), size, seconds,
                   float(environ.get(ENV_VIDEO_DELAY) or 0.0), crash, crash_s)


def with_delay_site(env: Mapping[str, str]) -> dict[str, str]:
    """`env`, with `DELAY_SITE` first on its PYTHONPATH when it asks for a delay."""
    env = dict(env)
    if EncoderDelays.from_env(env) != EncoderDelays():
        env["PYTHONPATH"] = os.pathsep.join([DELAY_SITE, *filter(None, [env.get("PYTHONPATH")])])
    return env


def _size(dims: str) -> tuple[int, int]:
    """"WxH" -> (width, height)."""
    width, _, height = dims.partition("x")
    return int(width), int(height)
