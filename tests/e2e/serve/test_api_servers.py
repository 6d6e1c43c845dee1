"""`epd serve --api-servers 2`: two API processes behind one port, one set of
workers (e-p-d, so KV moves and the decode worker too must send each request's
tokens to the API process that asked). Every check runs through each API
process on purpose, over its own unix socket; /metrics through the shared
port. Killing an API process or a worker leaves the server serving."""
from __future__ import annotations

import json
import os
import re
import signal
import time

import httpx
import openai
import pytest
from testkit.hf_reference import hf_generate_text
from testkit.media import CHATS
from testkit.server import start_server

MAX_TOKENS = 10
API_SERVERS = (0, 1)
GREEDY_CHATS = ("text_only", "two_images")  # tests/e2e/serve/test_serve.py runs all of CHATS in every mode


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    srv = start_server(tiny_model, tmp_path_factory.mktemp("api-servers"), "e-p-d", "--api-servers", "2")
    deadline = time.monotonic() + 120
    while len(own_sockets(srv)) < 2:  # the shared port answered: wait for both processes
        assert time.monotonic() < deadline, srv.log()
        time.sleep(0.2)
    yield srv
    assert srv.stop() == 0, srv.log()
    assert not srv.group_alive(), "a server process survived Ctrl-C"


@pytest.fixture(scope="module")
def expected(tiny_model):
    return {name: hf_generate_text(tiny_model, *CHATS[name], max_new_tokens=MAX_TOKENS)
            for name in (*GREEDY_CHATS, "one_image")}


def own_sockets(server) -> dict[int, str]:
    """API process index -> its own unix socket, from its latest 'ready' line."""
    return {int(k): path for k, path in re.findall(r"EPD: API server (\d+) pid \d+ ready; its own socket unix:(\S+)",
                                                   server.log())}


def api_pids(server) -> dict[int, int]:
    """API process index -> its latest pid."""
    return {int(k): int(pid) for k, pid in re.findall(r"EPD: API server (\d+) pid (\d+)\n", server.log())}


def http_client(server, index: int) -> httpx.Client:
    transport = httpx.HTTPTransport(uds=own_sockets(server)[index])
    return httpx.Client(transport=transport, base_url="http://epd", timeout=120)


def client(server, index: int) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://epd/v1", api_key="none", max_retries=0,
                         http_client=http_client(server, index))


def model_id(server) -> str:
    return httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]


@pytest.mark.parametrize("index", API_SERVERS)
def test_greedy_text_equals_transformers_through_each_api_process(server, expected, index):
    c, model = client(server, index), model_id(server)
    for name in GREEDY_CHATS:
        messages, _ = CHATS[name]
        r = c.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].message.content == expected[name], name
        chunks = c.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == expected[name], name


@pytest.mark.parametrize("index", API_SERVERS)
def test_n_and_stop_strings_through_each_api_process(server, expected, index):
    c, model = client(server, index), model_id(server)
    messages, _ = CHATS["text_only"]
    full = expected["text_only"]
    r = c.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, n=3)
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2]
    assert all(ch.message.content == full for ch in r.choices)  # greedy: three times the same text
    assert r.usage.completion_tokens == 3 * MAX_TOKENS
    stop = re.search(r"[a-z]{2}", full[2:]).group()  # plain letters, past the first two characters
    r = c.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[:full.index(stop)]


@pytest.mark.parametrize("index", API_SERVERS)
def test_a_client_leaving_mid_stream_aborts_the_workers_request(server, index):
    settle(server)
    aborted = server.settled_sum("epd:requests_aborted_total", role="decode")
    body = {"model": model_id(server), "messages": CHATS["text_only"][0], "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with http_client(server, index) as h, h.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        num_chunks = 0
        while num_chunks < 20:
            num_chunks += next(lines).startswith("data: {")
    settle(server)  # every block freed, nothing running
    assert server.settled_sum("epd:requests_aborted_total", role="decode") == aborted + 1


def settle(server, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    names = ("epd:num_requests_running", "epd:num_requests_waiting", "epd:kv_cache_usage_perc")
    while any(server.metric_sum(n) for n in names):
        assert time.monotonic() < deadline, {n: server.metric_sum(n) for n in names}
        time.sleep(0.1)


def test_metrics_add_up_over_api_processes(server):
    def scrape(index: int) -> str:
        with http_client(server, index) as h:
            return h.get("/metrics").text

    def generated() -> float:
        return server.metric_sum("epd:generation_tokens_total")

    before, successes = generated(), server.metric_sum("epd:request_success_total")
    completion_tokens = 0
    for index in API_SERVERS:
        r = client(server, index).completions.create(model=model_id(server), prompt="Count the boats.",
                                                     max_tokens=7, temperature=0)
        completion_tokens += r.usage.completion_tokens
    assert completion_tokens == 14
    assert generated() == before + completion_tokens  # both processes' tokens, through whichever took the scrape
    assert server.metric_sum("epd:request_success_total") == successes + 2
    line = re.compile(r"^epd:generation_tokens_total\{.*$", re.M)
    assert line.findall(scrape(0)) == line.findall(scrape(1))  # each process renders the same sum


def test_a_killed_worker_is_failed_over_by_every_api_process(server, expected):
    pid = int(re.findall(r"EPD: worker decode-0 pid (\d+)", server.log())[-1])
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 180
    while server.metric_sum("epd:worker_restarts_total", role="decode") < 1:  # counted by the launcher
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.2)
    # each API process was told (WorkerExited) and logged it, rather than waiting to notice the silence
    while server.log().count("worker decode-0 exited (code -9)") < len(API_SERVERS):
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.2)
    messages, _ = CHATS["one_image"]
    for index in API_SERVERS:  # the restarted worker registered with both
        while client_health(server, index) != 200:
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.2)
        r = client(server, index).chat.completions.create(model=model_id(server), messages=messages,
                                                          max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].message.content == expected["one_image"]
    for index in API_SERVERS:
        with http_client(server, index) as h:
            assert "epd:worker_restarts_total{role=\"decode\"} 1.0" in h.get("/metrics").text


def client_health(server, index: int) -> int:
    with http_client(server, index) as h:
        return h.get("/health").status_code


def test_a_killed_api_process_leaves_the_other_serving_and_is_restarted(server, expected):
    messages, _ = CHATS["text_only"]
    model = model_id(server)
    old_pid = api_pids(server)[1]
    settle(server)
    aborted = server.settled_sum("epd:requests_aborted_total", role="decode")
    body = {"model": model, "messages": messages, "max_tokens": 400, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with http_client(server, 1) as h, h.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        num_chunks = 0
        while num_chunks < 20:  # API process 1 streams a long answer from the decode worker...
            num_chunks += next(lines).startswith("data: {")
        os.kill(old_pid, signal.SIGKILL)  # ...and dies under it
    settle(server)  # the launcher told the workers: the request is dropped, not run to its end
    assert server.settled_sum("epd:requests_aborted_total", role="decode") == aborted + 1
    generated = server.metric_sum("epd:generation_tokens_total")
    for _ in range(6):  # the shared port: only API process 0 accepts now
        r = httpx.post(server.base_url + "/v1/chat/completions", timeout=120,
                       json={"model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == expected["text_only"]
    deadline = time.monotonic() + 180
    while api_pids(server)[1] == old_pid or len(re.findall(r"EPD: API server 1 pid \d+ ready", server.log())) < 2:
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.2)
    assert "API server 1 exited with code -9; restarting" in server.log()
    r = client(server, 1).chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                  temperature=0)
    assert r.choices[0].message.content == expected["text_only"]
    # the dead process's counts stay in the sum: the counter never goes back
    assert server.metric_sum("epd:generation_tokens_total") == generated + 7 * MAX_TOKENS


def test_sigterm_drains_every_api_process_then_stops_everything(server):
    """Last: it stops the module's server. Each API process finishes its own
    stream, refuses new requests meanwhile, then the launcher stops the workers."""
    model, max_tokens = model_id(server), 200
    body = {"model": model, "messages": CHATS["text_only"][0], "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    clients = [http_client(server, index) for index in API_SERVERS]
    streams = [c.stream("POST", "/v1/chat/completions", json=body) for c in clients]
    responses = [s.__enter__() for s in streams]
    lines = [r.iter_lines() for r in responses]
    for it in lines:  # both streams are under way
        while not next(it).startswith("data: {"):
            pass
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 60
    for c in clients:  # each process, still streaming, meets new requests with the drain's 503
        while (r := c.post("/v1/chat/completions", json={"model": model, "messages": CHATS["text_only"][0],
                                                         "max_tokens": 1})).status_code == 200:
            assert time.monotonic() < deadline  # the launcher passes SIGTERM on within 0.1 s
            time.sleep(0.05)
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], r.text
    for it in lines:
        usage = [u for u in (_usage(line) for line in it) if u]
        assert usage and usage[-1]["completion_tokens"] == max_tokens  # finished, not cut
    for s in streams:
        s.__exit__(None, None, None)
    assert server.proc.wait(120) == 0, server.log()[-3000:]
    assert "EPD: stopped; every worker exited" in server.log()
    assert not server.group_alive()


def _usage(line: str) -> dict | None:
    if not line.startswith("data: {"):
        return None
    return json.loads(line[6:]).get("usage")
