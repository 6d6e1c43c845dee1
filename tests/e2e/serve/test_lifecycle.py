"""SIGTERM drains: requests in flight finish, new ones get 503 with Retry-After,
then the server stops like Ctrl-C: exit 0, no process and no run directory left.

A cache fault is the server's, never the request's: on the same e-p-d server
(one start for both), an embedding too large for `--mm-cache-gb` travels
inline to the prefill worker and the answer is transformers' own."""
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest
from testkit.hf_reference import hf_generate_text
from testkit.media import CHATS
from testkit.server import chat_text, start_server

CACHE_FAULT_MAX_TOKENS = 10
MAX_TOKENS = 3000  # long enough to be in flight while the drain is probed (the tiny model: ~4k context)


@pytest.fixture(scope="module")
def epd_server(tiny_model, tmp_path_factory):
    """e-p-d with a ~1 KB embedding cache (no embedding of the tiny model fits) and a long
    drain; the SIGTERM test below stops it."""
    server = start_server(tiny_model, tmp_path_factory.mktemp("lifecycle"), "e-p-d", "--shutdown-grace", "120",
                          "--mm-cache-gb", "0.000001")
    yield server
    assert server.stop() == 0, server.log()


@pytest.mark.slow
def test_embeddings_too_large_for_the_cache_travel_inline(tiny_model, epd_server):
    messages, images = CHATS["two_images"]
    expected = hf_generate_text(tiny_model, messages, images, max_new_tokens=CACHE_FAULT_MAX_TOKENS)
    for stream in (False, True):
        assert chat_text(epd_server, messages, CACHE_FAULT_MAX_TOKENS, stream=stream) == expected
    assert epd_server.settled_sum("epd:encoder_images_total", role="encoder") == 4  # nothing came from the cache


@pytest.mark.slow
def test_sigterm_lets_requests_in_flight_finish_then_exits_cleanly(epd_server):
    """Last on the module's server: it stops it."""
    server = epd_server
    run_dir = re.search(r"api=ipc://(\S+)/api\.sock", server.log()).group(1)
    assert os.path.isdir(run_dir) and oct(os.stat(run_dir).st_mode & 0o777) == "0o700"
    model = httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "messages": CHATS["text_only"][0], "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    first_token, chunks = threading.Event(), []

    def stream():
        with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    first_token.set()

    client = threading.Thread(target=stream)
    client.start()
    assert first_token.wait(120)
    server.proc.send_signal(signal.SIGTERM)
    refused = None
    while client.is_alive() and refused is None:  # a new request meets the drain
        r = httpx.post(server.base_url + "/v1/chat/completions", timeout=30,
                       json={"model": model, "messages": CHATS["text_only"][0], "max_tokens": 1})
        if r.status_code == 503:
            refused = r
    client.join(300)
    assert refused is not None, "the request finished before the drain could be seen"
    assert refused.headers["retry-after"] and "shutting down" in refused.json()["error"]["message"]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == MAX_TOKENS  # finished, not cut
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert server.proc.wait(120) == 0, server.log()[-3000:]
    assert "EPD: stopped; every worker exited" in server.log()
    assert not os.path.exists(run_dir)
    assert not server.group_alive()


@pytest.mark.slow
def test_a_killed_launcher_leaves_no_process_behind(tiny_model, tmp_path):
    """SIGKILL to `epd serve` (no drain, no Shutdown): the workers, forked from the launcher's
    forkserver (their parent process), see the launcher go and exit, and the forkserver with them."""
    server = start_server(tiny_model, tmp_path, "e-p-d")
    workers = [int(pid) for pid in re.findall(r"EPD: worker \S+ pid (\d+)", server.log())]
    assert len(workers) == 3
    assert all(_parent(pid) != server.proc.pid for pid in workers)  # the forkserver's children
    server.proc.kill()
    server.proc.wait(30)
    assert not server.group_alive(grace_s=30), [_parent(pid) for pid in workers]


def _parent(pid: int) -> int | None:
    """`pid`'s parent process id; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except FileNotFoundError:
        return None


@pytest.mark.slow
def test_a_request_past_its_deadline_gets_an_error_and_frees_its_worker(tiny_model, tmp_path):
    server = start_server(tiny_model, tmp_path, "aggregated", "--request-timeout", "2")
    try:
        model = httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "messages": CHATS["text_only"][0], "max_tokens": MAX_TOKENS, "ignore_eos": True,
                "temperature": 0}
        r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 503 and "--request-timeout" in r.json()["error"]["message"]
        assert r.headers["retry-after"]
        streamed = httpx.post(server.base_url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60)
        assert streamed.status_code == 200  # the first token came in time; the error comes in-band
        events = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and "--request-timeout" in events[-2]
        assert server.metric_sum("epd:requests_failed_total", reason="timeout") == 2
        assert server.settled_sum("epd:requests_aborted_total") == 2  # the worker let both go
        assert server.settled_sum("epd:num_requests_running") == 0
    finally:
        assert server.stop() == 0


@pytest.mark.slow
def test_requests_still_running_past_the_grace_end_with_an_openai_error(tiny_model, tmp_path):
    """SIGTERM to the API alone with --shutdown-grace 3 while two long requests run
    (issue 33, item 6): the plain one gets a JSON 503, the stream an error event and
    [DONE]; no traceback in the log, exit 0 (uvicorn used to cut both off after its
    own 3 s: a plain-text 500 and a stream with no end)."""
    server = start_server(tiny_model, tmp_path, "aggregated", "--shutdown-grace", "3")  # a loaded CI host's late requests fit
    _past_the_grace(server, lambda: server.proc.send_signal(signal.SIGTERM))


@pytest.mark.slow
def test_sigterm_to_the_whole_group_ends_requests_as_sigterm_to_the_api_does(tiny_model, tmp_path):
    """SIGTERM to every process of `epd serve` at once (systemd's KillMode=control-group,
    a terminal's job control; issue 44, item 6): the workers (and the forkserver they
    fork from) get it too, yet serve on until the launcher stops them, so the requests
    still running past the grace end exactly as with SIGTERM to the API alone (they used
    to lose their worker: a plain-text 500 and a stream with no end). `--api-servers 2`
    under the same signal: bench/dev/reliability_probe_shutdown.py."""
    server = start_server(tiny_model, tmp_path, "e-pd", "--shutdown-grace", "3")
    _past_the_grace(server, lambda: os.killpg(server.pgid, signal.SIGTERM))
    # no worker went with the signal (they used to exit at once, and were restarted while the API drained)
    assert not re.search(r"worker \S+ exited", server.log()), server.log()[-3000:]


def _past_the_grace(server, send_sigterm) -> None:
    """Two long requests (plain, streamed) running when `send_sigterm()` is called: a
    new one gets a 503 during the grace; past it the plain one gets a JSON 503, the
    stream an error event and [DONE]; the server exits 0, no traceback, no process left."""
    model = httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "messages": CHATS["text_only"][0], "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "temperature": 0}
    answers, events, first_token = {}, [], threading.Event()

    def plain():
        answers["plain"] = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)

    def stream():
        with httpx.stream("POST", server.base_url + "/v1/chat/completions", json={**body, "stream": True},
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first_token.set()

    clients = [threading.Thread(target=plain), threading.Thread(target=stream)]
    for client in clients:
        client.start()
    assert first_token.wait(60)
    deadline = time.monotonic() + 60
    while server.metric_sum("epd:num_requests_running") < 2:  # both are in the worker
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.1)
    send_sigterm()
    for _ in range(20):  # one token each, until the signal has been handled
        late = httpx.post(server.base_url + "/v1/chat/completions", json={**body, "max_tokens": 1}, timeout=10)
        if late.status_code != 200:
            break
        time.sleep(0.1)
    assert late.status_code == 503 and late.headers["retry-after"], late.text  # draining: refused, not unanswered
    for client in clients:
        client.join(120)
    refused = answers["plain"]
    assert refused.status_code == 503 and refused.headers["retry-after"], refused.text
    assert "shutting down" in refused.json()["error"]["message"]
    assert events[-1] == "[DONE]" and "shutting down" in json.loads(events[-2])["error"]["message"], events[-3:]
    assert server.proc.wait(60) == 0, server.log()[-3000:]
    assert "Traceback" not in server.log(), server.log()[-3000:]
    assert not server.group_alive(grace_s=30)
