"""A poison request (issue 44, item 1): a request whose work kills a worker is
failed, not sent into every restarted worker; the others the dead worker held
are sent again; a request the API gave up on costs the encoder nothing.

One real e-pd server, its encoder given a test fault (tests/testkit/encoder_delays.py
ENV_CRASH_IMAGE): a batch holding an image of POISON's size SIGKILLs the
encoder CRASH_AFTER_S into it, as the kernel's OOM killer ends an encoder whose
memory grew, and every batch takes BATCH_DELAY_S more, so that requests queue
behind one another whatever the machine's speed. The pd worker is killed by the
test itself (SIGKILL) while it streams."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time

import httpx
import pytest
from testkit.api_checks import assert_error
from testkit.hf_reference import hf_generate_text
from testkit.media import describe, image_bytes
from testkit.server import ServerProcess, free_port

POISON = image_bytes(72, 40, seed=44)  # its size is the fault's: every batch holding it kills the encoder
CRASH_AFTER_S = 3.0  # the encoder dies this long into the poison's batch: time to queue other work behind it
BATCH_DELAY_S = 2.0
MAX_TOKENS = 6
REQUEST_TIMEOUT_S = 240  # a restart loads torch and the model again on 2 busy cores
RESTART_S = 180


def _start(model_dir: str, tmp_path) -> ServerProcess:
    from testkit.encoder_delays import ENV_BATCH_DELAY, ENV_CRASH_IMAGE

    port = free_port()
    args = ["serve", model_dir, "--mode", "e-pd", "--port", str(port), "--num-kv-blocks", "300", "--dtype",
            "float32", "--device", "cpu", "--threads-per-worker", "1", "--request-timeout", str(REQUEST_TIMEOUT_S)]
    env = {**os.environ, ENV_CRASH_IMAGE: f"72x40:{CRASH_AFTER_S}", ENV_BATCH_DELAY: str(BATCH_DELAY_S)}
    return ServerProcess(args, port, str(tmp_path / "server.log"), env=env).wait_ready(RESTART_S)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    srv = _start(tiny_model, tmp_path_factory.mktemp("poison"))
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def _chat(server: ServerProcess, image: bytes, **extra) -> httpx.Response:
    body = {"model": _model(server), "messages": describe(image), "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S + 30)


def _model(server: ServerProcess) -> str:
    return httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]


def _in_thread(call) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    return thread, out


def _wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"
        time.sleep(0.1)


def _pids(server: ServerProcess, worker: str) -> list[int]:
    return [int(p) for p in re.findall(rf"EPD: worker {worker} pid (\d+)", server.log())]


def _restarted(server: ServerProcess, worker: str, num_processes: int) -> None:
    """Until `worker` has run as `num_processes` processes and /health is 200 again."""
    _wait_until(lambda: len(_pids(server, worker)) == num_processes, RESTART_S, f"{worker} restarted")
    server.wait_health(200, RESTART_S)


def _assert_poison(response: httpx.Response) -> None:
    error = assert_error(response, 400, "died while encoding this request's images", "messages")
    assert error["code"] == "input_crashed_worker"


def test_the_request_that_kills_its_encoder_fails_after_one_death(server, tiny_model):
    """The poison image alone in its batch: a 400 after ONE encoder death (it used to be
    sent into each restarted encoder, four deaths); another user's image, queued behind
    it in the same encoder, is sent again and answered as transformers answers it."""
    from testkit.encoder_delays import CRASH_LOG

    other = image_bytes(96, 64, seed=45)
    expected = hf_generate_text(tiny_model, describe(other), [other], MAX_TOKENS)
    restarts = server.metric_sum("epd:worker_restarts_total", role="encoder")
    failed = server.metric_sum("epd:requests_failed_total", reason="poison")
    processes = len(_pids(server, "encoder-0"))
    crashes = server.log().count(CRASH_LOG)
    poison_thread, poisoned = _in_thread(lambda: _chat(server, POISON))
    _wait_until(lambda: server.log().count(CRASH_LOG) > crashes, 60, "the encoder taking the poison image")
    other_thread, answered = _in_thread(lambda: _chat(server, other))  # queued behind it
    poison_thread.join(REQUEST_TIMEOUT_S + 60)
    other_thread.join(REQUEST_TIMEOUT_S + 60)
    _assert_poison(poisoned[0])
    assert answered[0].status_code == 200, answered[0].text
    assert answered[0].json()["choices"][0]["message"]["content"] == expected
    _restarted(server, "encoder-0", processes + 1)
    assert server.metric_sum("epd:worker_restarts_total", role="encoder") == restarts + 1
    assert server.metric_sum("epd:requests_failed_total", reason="poison") == failed + 1
    assert server.log().count(CRASH_LOG) == crashes + 1  # nothing sent the poison image to the restarted encoder


def test_poison_sharing_a_batch_is_sent_again_alone_then_failed(server, tiny_model):
    """The poison image batched with another user's: both are suspects of the death,
    so each is sent again alone; the other is answered, the poison kills its encoder
    once more, alone, and fails: two deaths, bounded."""
    innocent = image_bytes(96, 64, seed=46)
    expected = hf_generate_text(tiny_model, describe(innocent), [innocent], MAX_TOKENS)
    restarts = server.metric_sum("epd:worker_restarts_total", role="encoder")
    failed = server.metric_sum("epd:requests_failed_total", reason="poison")
    processes = len(_pids(server, "encoder-0"))
    blocker, _ = _in_thread(lambda: _chat(server, image_bytes(96, 64, seed=47)))  # the encoder busy meanwhile
    time.sleep(0.5)
    poison_thread, poisoned = _in_thread(lambda: _chat(server, POISON))
    innocent_thread, answered = _in_thread(lambda: _chat(server, innocent))
    for thread in (blocker, poison_thread, innocent_thread):
        thread.join(REQUEST_TIMEOUT_S + 60)
    assert "died while encoding the items of 2 requests" in server.log()  # they shared the batch
    _assert_poison(poisoned[0])
    assert answered[0].status_code == 200, answered[0].text
    assert answered[0].json()["choices"][0]["message"]["content"] == expected
    _restarted(server, "encoder-0", processes + 2)
    assert server.metric_sum("epd:worker_restarts_total", role="encoder") == restarts + 2
    assert server.metric_sum("epd:requests_failed_total", reason="poison") == failed + 1


def test_a_request_given_up_costs_the_encoder_nothing(server):
    """A client gone while its image waits in the encoder's queue: the Abort takes the
    image out unencoded (epd:encoder_images_aborted_total), and it never comes back."""
    server.wait_health(200, RESTART_S)
    encoded = server.settled_sum("epd:encoder_images_total")
    aborted = server.settled_sum("epd:encoder_images_aborted_total")
    queried = server.metric_sum("epd:mm_cache_queries_total")
    blocker, answered = _in_thread(lambda: _chat(server, image_bytes(96, 64, seed=48)))
    _wait_until(lambda: server.metric_sum("epd:mm_cache_queries_total") >= queried + 1, 30, "the first image sent")
    body = {"model": _model(server), "messages": describe(image_bytes(96, 64, seed=49)), "max_tokens": MAX_TOKENS,
            "stream": True}
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: epd\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % len(payload) + payload)
        _wait_until(lambda: server.metric_sum("epd:mm_cache_queries_total") >= queried + 2, 30,
                    "the second image sent")  # its EncodeRequest left: queued behind the first
    blocker.join(REQUEST_TIMEOUT_S)
    assert answered[0].status_code == 200, answered[0].text
    assert server.settled_sum("epd:encoder_images_aborted_total") == aborted + 1
    assert server.settled_sum("epd:encoder_images_total") == encoded + 1  # the first image only


def test_a_stream_on_two_dying_engine_workers_fails_instead_of_resuming_again(server, tiny_model):
    """Every request on an engine worker is a suspect of its death: resumed after the
    first (as test_chaos expects), failed after the second (--max-request-worker-deaths
    2) with an error event and [DONE], instead of a third worker's death."""
    restarts = server.metric_sum("epd:worker_restarts_total", role="pd")
    failed = server.metric_sum("epd:requests_failed_total", reason="poison")
    processes = len(_pids(server, "pd-0"))
    body = {"model": _model(server), "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 3900, "temperature": 0, "ignore_eos": True, "stream": True}
    chunks: list[dict] = []
    lines: list[str] = []
    kills, killed_at = 0, 0  # the pd worker running it is killed after 5 chunks, then 5 chunks into the resumed try
    with httpx.Client(timeout=REQUEST_TIMEOUT_S + 30) as client, \
            client.stream("POST", server.base_url + "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        for line in filter(None, response.iter_lines()):
            lines.append(line)
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
            if kills < 2 and len(chunks) >= killed_at + 5 and len(_pids(server, "pd-0")) == processes + kills:
                os.kill(_pids(server, "pd-0")[-1], signal.SIGKILL)
                kills, killed_at = kills + 1, len(chunks)
    assert kills == 2, f"the stream ended before its second worker died ({len(chunks)} chunks)"
    assert lines[-1] == "data: [DONE]"
    errors = [c["error"] for c in chunks if "error" in c]
    assert len(errors) == 1 and errors[0]["code"] == "input_crashed_worker", errors
    assert "2 workers died while running this request" in errors[0]["message"]
    _restarted(server, "pd-0", processes + 2)
    assert server.metric_sum("epd:worker_restarts_total", role="pd") == restarts + 2
    assert server.metric_sum("epd:requests_failed_total", reason="poison") == failed + 1
    assert server.metric_sum("epd:requests_recovered_total", how="resumed") >= 1
