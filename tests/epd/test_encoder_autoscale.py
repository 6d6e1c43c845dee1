"""`epd serve --encoders 1-2` end to end: a burst of image requests (every image
distinct, so nothing is cached; every encoder batch made a second longer
through `EPD_TEST_ENCODER_BATCH_DELAY_S`, so the queue backs up on a fast
machine as on a busy one) backs the encoder's queue up and a second
encoder is started and takes images; when the traffic stops it is idle and the
pool is back to one encoder. Seen through /metrics and /health, every answer
transformers' text, the removed worker never restarted."""
from __future__ import annotations

import io
import threading
import time

import httpx
import numpy as np
from hf_reference import hf_generate_text
from media import image_part
from PIL import Image
from server import start_server

from epd.encoders.encoder_worker import BATCH_DELAY_ENV

MAX_TOKENS = 4
NUM_CLIENTS = 3
SCALE_UP_DEADLINE_S = 240  # a new encoder loads torch and the model: long on a busy 2-core machine
BATCH_DELAY_S = 1.0  # far above the scale-up threshold below
SCALE_DOWN_DEADLINE_S = 90
REMOVE_DEADLINE_S = 60  # the supervisor gives a removed worker 30 s before SIGKILL
UP, DOWN = 'epd:encoder_scaling_decisions_total{direction="up"}', 'epd:encoder_scaling_decisions_total{direction="down"}'


def costly_image(seed: int, size: int = 2000) -> bytes:
    """A PNG of a few KiB that decodes to `size`² pixels: cheap for the API (it reads
    the header), a few hundred ms for the encoder (decode and resize)."""
    pixels = np.zeros((size, size, 3), np.uint8)
    pixels[::97, ::89] = 255
    pixels[:32, :32] = np.random.default_rng(seed).integers(0, 256, (32, 32, 3))
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def messages_for(image: bytes) -> list[dict]:
    return [{"role": "user", "content": [image_part(image), {"type": "text", "text": "Describe it."}]}]


def ask(base_url: str, model: str, image: bytes) -> tuple[int, str]:
    body = {"model": model, "messages": messages_for(image), "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=300)
    return r.status_code, r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text


class Burst:
    """NUM_CLIENTS threads sending requests with fresh images back to back until stopped."""

    def __init__(self, base_url: str, model: str):
        self.results: dict[int, tuple[int, str]] = {}  # image seed -> (status, text)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(base_url, model, c), daemon=True)
                         for c in range(NUM_CLIENTS)]

    def _loop(self, base_url: str, model: str, client: int) -> None:
        seed = 1000 * client
        while not self._stop.is_set():
            try:
                self.results[seed] = ask(base_url, model, costly_image(seed))
            except httpx.HTTPError as exc:
                self.results[seed] = (-1, repr(exc))
            seed += 1

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join(timeout=330)


def wait_for(server, condition, deadline_s: float, what: str) -> dict[str, float]:
    """The metrics once `condition(metrics)` holds; fails naming `what` after the deadline."""
    deadline = time.monotonic() + deadline_s
    while True:
        metrics = server.metrics()
        if condition(metrics):
            return metrics
        assert time.monotonic() < deadline, f"{what}: not within {deadline_s} s; metrics: " + str(
            {k: v for k, v in metrics.items() if "encoder" in k}) + "\n" + server.log()[-3000:]
        time.sleep(0.25)


def test_a_burst_adds_an_encoder_and_idleness_removes_it(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv(BATCH_DELAY_ENV, str(BATCH_DELAY_S))  # the server's workers inherit it
    server = start_server(tiny_model, tmp_path, "e-p-d", "--encoders", "1-2",
                          "--encoder-scale-up-queue-s", "0.3", "--encoder-scale-up-window-s", "0.5",
                          "--encoder-idle-s", "4", "--encoder-scale-cooldown-s", "1")
    try:
        model = httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
        start = server.metrics()
        assert (start["epd:encoders"], start[UP], start[DOWN]) == (1, 0, 0)

        with Burst(server.base_url, model) as burst:
            def second_encoder_works(m):  # up, registered, and it encoded images of the burst
                return m["epd:encoders"] == 2 and any(
                    k.startswith("epd:encoder_images_total") and 'worker="encoder-1"' in k and v > 0
                    for k, v in m.items())
            grown = wait_for(server, second_encoder_works, SCALE_UP_DEADLINE_S, "a second encoder taking images")
        assert grown[UP] >= 1
        assert burst.results and all(status == 200 for status, _ in burst.results.values()), burst.results

        shrunk = wait_for(server, lambda m: m["epd:encoders"] == 1 and m[DOWN] >= 1, SCALE_DOWN_DEADLINE_S,
                          "back to one encoder")
        assert shrunk[UP] == shrunk[DOWN]  # every encoder added was removed again, down to MIN
        assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
        assert sum(v for k, v in shrunk.items() if k.startswith("epd:worker_restarts_total")) == 0

        # answers are right: during the burst, and through the one encoder left
        after = costly_image(seed=999_999)
        status, text = ask(server.base_url, model, after)
        assert status == 200
        for seed, (_, burst_text) in sorted(burst.results.items())[:2]:
            assert burst_text == hf_generate_text(tiny_model, messages_for(costly_image(seed)),
                                                  [costly_image(seed)], MAX_TOKENS)
        assert text == hf_generate_text(tiny_model, messages_for(after), [after], MAX_TOKENS)
        assert "adding encoder-1" in server.log()
        deadline = time.monotonic() + REMOVE_DEADLINE_S
        while " removed (exit code" not in server.log():  # reaped once it exited
            assert time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.25)
        assert " removed (exit code 0)" in server.log(), server.log()[-3000:]  # it stopped on its own
    finally:
        assert server.stop() == 0, server.log()[-3000:]
    assert not server.group_alive()
