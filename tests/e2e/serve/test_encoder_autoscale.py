"""`epd serve --encoders 1-2` end to end: a burst of image requests (every image
distinct, so nothing is cached; every encoder batch made a second longer
through `EPD_TEST_ENCODER_BATCH_DELAY_S`, tests/testkit/encoder_delays.py, so the queue backs up on a fast
machine as on a busy one) backs the encoder's queue up and a second
encoder is started and takes images; when the traffic stops it is idle and the
pool is back to one encoder. Seen through /metrics and /health, every answer
transformers' text, the removed worker never restarted."""
from __future__ import annotations

import time

import httpx
from testkit.encoder_delays import ENV_BATCH_DELAY
from testkit.hf_reference import hf_generate_text
from testkit.media import costly_image, describe
from testkit.server import image_burst, start_server

MAX_TOKENS = 4
NUM_CLIENTS = 3
SCALE_UP_DEADLINE_S = 240  # a new encoder loads torch and the model: long on a busy 2-core machine
BATCH_DELAY_S = 1.0  # far above the scale-up threshold below
SCALE_DOWN_DEADLINE_S = 90
REMOVE_DEADLINE_S = 60  # the supervisor gives a removed worker 30 s before SIGKILL
UP, DOWN = 'epd:encoder_scaling_decisions_total{direction="up"}', 'epd:encoder_scaling_decisions_total{direction="down"}'


def ask(base_url: str, model: str, image: bytes) -> tuple[int, str]:
    body = {"model": model, "messages": describe(image), "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=300)
    return r.status_code, r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text


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
    monkeypatch.setenv(ENV_BATCH_DELAY, str(BATCH_DELAY_S))  # the server's workers inherit it
    server = start_server(tiny_model, tmp_path, "e-p-d", "--encoders", "1-2",
                          "--encoder-scale-up-queue-s", "0.3", "--encoder-scale-up-window-s", "0.5",
                          "--encoder-idle-s", "4", "--encoder-scale-cooldown-s", "1")
    try:
        model = httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
        start = server.metrics()
        assert (start["epd:encoders"], start[UP], start[DOWN]) == (1, 0, 0)

        with image_burst(server.base_url, NUM_CLIENTS, MAX_TOKENS) as burst:
            def second_encoder_works(m):  # up, registered, and it encoded images of the burst
                return m["epd:encoders"] == 2 and any(
                    k.startswith("epd:encoder_images_total") and 'worker="encoder-1"' in k and v > 0
                    for k, v in m.items())
            grown = wait_for(server, second_encoder_works, SCALE_UP_DEADLINE_S, "a second encoder taking images")
        assert grown[UP] >= 1
        answers = {seed: (status, text) for *_, (seed, status, text) in burst.results}
        assert answers and all(status == 200 for status, _ in answers.values()), answers

        shrunk = wait_for(server, lambda m: m["epd:encoders"] == 1 and m[DOWN] >= 1, SCALE_DOWN_DEADLINE_S,
                          "back to one encoder")
        assert shrunk[UP] == shrunk[DOWN]  # every encoder added was removed again, down to MIN
        assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
        assert sum(v for k, v in shrunk.items() if k.startswith("epd:worker_restarts_total")) == 0

        # answers are right: during the burst, and through the one encoder left
        after = costly_image(seed=999_999)
        status, text = ask(server.base_url, model, after)
        assert status == 200
        for seed, (_, burst_text) in sorted(answers.items())[:2]:
            assert burst_text == hf_generate_text(tiny_model, describe(costly_image(seed)),
                                                  [costly_image(seed)], MAX_TOKENS)
        assert text == hf_generate_text(tiny_model, describe(after), [after], MAX_TOKENS)
        assert "adding encoder-1" in server.log()
        deadline = time.monotonic() + REMOVE_DEADLINE_S
        while " removed (exit code" not in server.log():  # reaped once it exited
            assert time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.25)
        assert " removed (exit code 0)" in server.log(), server.log()[-3000:]  # it stopped on its own
    finally:
        assert server.stop() == 0, server.log()[-3000:]
    assert not server.group_alive()
