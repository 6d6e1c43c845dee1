"""An inbox read by its own thread, each message stamped with the time it came in.

A worker that spends seconds in one batch (an encoder running its ViT) reads
its socket only between batches; what arrived meanwhile would look fresh.
Here a thread reads the socket as messages arrive, so a message's age is the
time since it really reached the worker: the encoder's queue time, and the
autoscaler's signal, count the wait behind a long batch too.

The thread is the socket's only user from `start()` until `stop()`; the
owner closes the Receiver after `stop()`.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator

from epd.transport.wire.channels import Receiver
from epd.transport.wire.codec import WireError
from epd.transport.wire.messages import Message

log = logging.getLogger("epd.transport")

POLL_S = 0.05  # how often the reading thread looks whether it should stop


class StampedInbox:
    def __init__(self, receiver: Receiver, name: str = ""):
        self.receiver = receiver
        self.name = name or receiver.address
        self._arrived: queue.SimpleQueue[tuple[Message, float]] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._read, name=f"inbox-{self.name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()

    def _read(self) -> None:
        while not self._stopping.is_set():
            try:
                msg = self.receiver.recv(POLL_S)
            except WireError as exc:  # garbage is logged and skipped, as Receiver.drain does
                log.warning("%s: dropped a malformed message: %s", self.name, exc)
                continue
            if msg is not None:
                self._arrived.put((msg, time.perf_counter()))

    def drain(self, timeout_s: float) -> Iterator[tuple[Message, float]]:
        """(message, perf_counter() when it arrived) for every message in now,
        waiting up to `timeout_s` for the first."""
        try:
            yield self._arrived.get(timeout=timeout_s) if timeout_s > 0 else self._arrived.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                yield self._arrived.get_nowait()
            except queue.Empty:
                return
