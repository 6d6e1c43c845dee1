"""`DelayedEncoderWorker`: the encoder worker loop with the delays and the fault of
testkit/encoder_delays.py, read from the process's environment. Every method it
overrides runs the product's own and adds the delay around it; the product loop
has no delay in it."""
from __future__ import annotations

import logging
import os
import signal
import time

from epd.encoders.encoder_worker import EncoderWorker
from epd.encoders.image_io import ImageError, read_image_size
from epd.transport.wire.messages import EncodeDone, EncodeRequest
from testkit.encoder_delays import CRASH_LOG, VIDEO_DELAY_LOG, EncoderDelays

log = logging.getLogger("epd.encoder")


class DelayedEncoderWorker(EncoderWorker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.delays = EncoderDelays.from_env(os.environ)
        self._held: list[tuple[float, str, EncodeDone]] = []  # (send at, reply_to, message): slow images only

    def _encode_jobs(self, batch) -> None:
        """A batch holding the poison image size dies, once the API knows what it holds."""
        size = self.delays.crash_image_size
        if size is not None and any(job.msg.video is None and self._has_size(job.msg.image, size) for job in batch):
            log.warning("%s: %s (%s)", self.spec.worker_id, CRASH_LOG, ", ".join(j.msg.request_id for j in batch))
            time.sleep(self.delays.crash_after_s)  # the batch's Alive(working_on) is out by then
            os.kill(os.getpid(), signal.SIGKILL)
        super()._encode_jobs(batch)

    def _image_results(self, *args) -> list:
        results = super()._image_results(*args)
        if self.delays.batch_delay_s:
            time.sleep(self.delays.batch_delay_s)
        return results

    def _video_results(self, job) -> list:
        if self.delays.video_delay_s:  # the worker busy inside this video's encode
            log.warning("%s: %s %s for %g s more", self.spec.worker_id, VIDEO_DELAY_LOG, job.msg.mm_hash[:12],
                        self.delays.video_delay_s)
            time.sleep(self.delays.video_delay_s)
        results = super()._video_results(job)
        if self.delays.batch_delay_s:  # a video (or a chunk) takes long enough to kill its encoder
            time.sleep(self.delays.batch_delay_s)
        return results

    def _send_done(self, msg: EncodeRequest, done: EncodeDone) -> None:
        """A slow image's EncodeDone is held back, without blocking the loop."""
        size = self.delays.slow_image_size
        if size is not None and msg.video is None and self._has_size(msg.image, size):
            self._held.append((time.monotonic() + self.delays.slow_image_s, msg.reply_to, done))
            return
        super()._send_done(msg, done)

    def _maybe_send_stats(self) -> None:
        """Once a loop turn, as the product's: the held EncodeDones that are due go first."""
        now = time.monotonic()
        for item in [h for h in self._held if h[0] <= now]:
            self._held.remove(item)
            self.outbox.send(item[1], item[2])
        super()._maybe_send_stats()

    def _has_size(self, image: bytes, size: tuple[int, int]) -> bool:
        try:
            return read_image_size(image, self.encoder.max_image_pixels) == size
        except (ImageError, ValueError):
            return False
