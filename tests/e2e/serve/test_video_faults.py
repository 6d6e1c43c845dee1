"""A SIGKILL of the encoder in the middle of a video's encode (issue 26): the
request fails with a clear OpenAI error (issue 44: the item an encoder was
encoding as it died is its suspect, a 400 `input_crashed_worker`, never sent
into the restarted encoder); it never hangs, and the server serves videos on. The encoder is held inside the video's encode
by a test delay (tests/testkit/encoder_delays.py) whose warning in the log tells the
test when to kill."""
from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import pytest
from testkit.api_checks import ERROR_KEYS
from testkit.media import data_url
from testkit.server import ServerProcess, free_port
from testkit.videos import encode_video, synthetic_frames

pytest.importorskip("av")
MAX_TOKENS = 6
REQUEST_TIMEOUT_S = 240  # the server's --request-timeout: a restart loads torch and the model again
START_S = 400  # a start (and a restart) on 2 busy shared cores
HOLD_S = 4.0  # each video's encode takes this much longer: the kill lands inside it
QUESTION = {"type": "text", "text": "What happens in the video?"}


def _chat(server: ServerProcess, clip: bytes) -> httpx.Response:
    body = {"model": "m", "max_tokens": MAX_TOKENS, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": data_url(clip, "video/mp4")}}, QUESTION]}]}
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S + 30)


def _wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"
        time.sleep(0.1)


@pytest.mark.slow
def test_sigkill_of_the_encoder_during_a_video_encode(tiny_model, tmp_path):
    from testkit.encoder_delays import ENV_VIDEO_DELAY, VIDEO_DELAY_LOG

    clip = encode_video(synthetic_frames(9, 48, 64, seed=31), "mp4", fps=4)
    port = free_port()
    server = ServerProcess(["serve", tiny_model, "--mode", "e-pd", "--encoders", "1", "--port", str(port),
                            "--served-model-name", "m", "--num-kv-blocks", "64", "--dtype", "float32",
                            "--device", "cpu", "--threads-per-worker", "1", "--request-timeout",
                            str(REQUEST_TIMEOUT_S)], port, str(tmp_path / "server.log"),
                           env={**os.environ, ENV_VIDEO_DELAY: str(HOLD_S)}).wait_ready(START_S)
    try:
        out: list[httpx.Response] = []
        sender = threading.Thread(target=lambda: out.append(_chat(server, clip)), daemon=True)
        sender.start()
        _wait_until(lambda: VIDEO_DELAY_LOG in server.log(), 120, "the encoder starting the video")
        [pid] = [int(p) for p in re.findall(r"EPD: worker encoder-0 pid (\d+)", server.log())]
        os.kill(pid, signal.SIGKILL)
        sender.join(REQUEST_TIMEOUT_S + 60)
        assert not sender.is_alive(), "the request hung"
        [response] = out
        print(f"SIGKILL of the encoder mid-video: HTTP {response.status_code}")
        # the video it was encoding is the suspect of its death: failed, not sent into the next encoder
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert set(error) == ERROR_KEYS and error["code"] == "input_crashed_worker", error
        assert "died while encoding this request's videos" in error["message"]
        _wait_until(lambda: len(re.findall(r"EPD: worker encoder-0 pid (\d+)", server.log())) == 2, START_S,
                    "the encoder restarted")
        server.wait_health(200, START_S)
        assert server.metric_sum("epd:worker_restarts_total", role="encoder") == 1
        assert server.log().count(VIDEO_DELAY_LOG) == 1  # nothing sent it to the restarted encoder
        again = _chat(server, encode_video(synthetic_frames(9, 48, 64, seed=32), "mp4", fps=4))
        assert again.status_code == 200, again.text
    finally:
        assert server.stop() == 0, server.log()[-3000:]
