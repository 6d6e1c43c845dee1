"""The OpenAI-compatible app under a real uvicorn, driven by the `openai` client and httpx.

`FakeOrchestrator` stands in for epd.serve.orchestrator (end-to-end tests with real
workers live elsewhere): it implements `OrchestratorLike` deterministically,
answering every sequence with tokens 10, 11, ... (shifted by the seed), text
" w<id>" per token, finishing with "stop" after 5 tokens or "length" at
max_tokens. Prompt words steer it: BAD -> RequestError before any Delta,
CRASH -> RuntimeError before any Delta, CRASHLATER -> RuntimeError after two
tokens, SLOW -> 20 ms per token and 1000 tokens (for disconnects).
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from epd.transport.sampling import TokenLogprobs
from epd.api.fast_path import http_protocol
from epd.api.server import ApiSettings, build_app
from epd.api.protocol import Delta, GenerateRequest, RequestError

MODEL = "qwen3-vl-test"
API_KEY = "sk-test"
NUM_STOP_TOKENS = 5
AUTH = {"Authorization": f"Bearer {API_KEY}"}


class FakeOrchestrator:
    model_name = MODEL
    max_model_len = 4096
    vocab_size = 1000

    def __init__(self):
        self.healthy = True
        self.requests: list[GenerateRequest] = []
        self.closed: set[str] = set()  # request ids whose generator ran its finally

    def missing_roles(self) -> list[str]:
        return [] if self.healthy else ["decode"]

    def metrics_text(self) -> bytes:
        return b"# TYPE epd:num_requests_running gauge\nepd:num_requests_running 0.0\n"

    def decode_token(self, token_id: int) -> str:
        return f" w{token_id}"

    async def tokenize(self, request: GenerateRequest, add_special_tokens: bool = False) -> list[int]:
        """As many tokens as generate() counts in the prompt (one more with special tokens)."""
        self.requests.append(request)
        text = request.prompt if request.messages is None else json.dumps(request.messages)
        if "BAD" in text:
            raise RequestError("the prompt is BAD", param="messages")
        return list(range(100, 100 + len(text.split()))) + ([1] if add_special_tokens else [])

    def detokenize(self, token_ids: list[int]) -> str:
        return "".join(self.decode_token(t) for t in token_ids)

    def token_strs(self, token_ids: list[int]) -> list[str]:
        return [f"w{t}" for t in token_ids]

    async def generate(self, request: GenerateRequest):
        self.requests.append(request)
        text = request.prompt if request.messages is None else json.dumps(request.messages)
        if "BAD" in text:
            raise RequestError("the prompt is BAD", param="messages")
        if "CRASH" in text and "CRASHLATER" not in text:
            raise RuntimeError("secret internal detail")
        num_prompt = len(text) if isinstance(text, list) else len(text.split())
        slow = "SLOW" in text
        num_stop = 1000 if slow else NUM_STOP_TOKENS
        limit = request.sampling.max_tokens or self.max_model_len - num_prompt
        k = request.sampling.logprobs
        try:
            for i in range(min(num_stop, limit)):
                await asyncio.sleep(0.02 if slow else 0)
                if "CRASHLATER" in text and i == 2:
                    raise RuntimeError("secret internal detail")
                tid = 10 + i + (request.sampling.seed or 0)
                finish = None if i + 1 < min(num_stop, limit) else ("stop" if num_stop <= limit else "length")
                logprobs = None if k is None else [
                    TokenLogprobs(tid, -0.25, 1, [(tid + j, -0.25 * (j + 1)) for j in range(k)])]
                yield Delta(text=self.decode_token(tid), token_ids=[tid], finish_reason=finish,
                            num_prompt_tokens=num_prompt, num_cached_tokens=2, logprobs=logprobs)
        finally:
            self.closed.add(request.request_id)


def _serve_app(fake: FakeOrchestrator, lean_routes: bool = True, max_body_bytes: int = 64 << 20,
               metrics_require_key: bool = False, **settings):
    settings = ApiSettings(**{"served_model_name": MODEL, **settings}, api_key=API_KEY,
                           max_request_body_bytes=max_body_bytes, metrics_require_key=metrics_require_key)
    app = build_app(fake, settings, lean_routes=lean_routes)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    # the HTTP protocol `epd serve` runs (writes joined per event-loop pass)
    uv = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off", http=http_protocol()))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", fake
    uv.should_exit = True
    thread.join(timeout=5)


@pytest.fixture(scope="module")
def server():
    yield from _serve_app(FakeOrchestrator())


@pytest.fixture
def base_url(server):
    return server[0]


@pytest.fixture
def fake(server):
    server[1].healthy = True
    return server[1]


@pytest.fixture
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def expected_text(num_tokens: int = NUM_STOP_TOKENS, seed: int = 0) -> str:
    return "".join(f" w{10 + i + seed}" for i in range(num_tokens))


def wait_until(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# -- chat ----------------------------------------------------------------------------------------

def test_chat_non_streaming(client, fake):
    out = client.chat.completions.create(model=MODEL, messages=user("two words"))
    assert out.object == "chat.completion" and out.model == MODEL and out.id.startswith("chatcmpl-")
    [choice] = out.choices
    assert (choice.index, choice.message.role, choice.message.content) == (0, "assistant", expected_text())
    assert choice.finish_reason == "stop" and choice.logprobs is None
    prompt_tokens = len(json.dumps(user("two words")).split())
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        prompt_tokens, NUM_STOP_TOKENS, prompt_tokens + NUM_STOP_TOKENS)
    assert out.usage.prompt_tokens_details.cached_tokens == 2
    assert fake.requests[-1].request_id == out.id and fake.requests[-1].sampling.max_tokens is None


def test_chat_length_and_max_completion_tokens(client, fake):
    out = client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=1, max_completion_tokens=3)
    assert out.choices[0].finish_reason == "length" and out.choices[0].message.content == expected_text(3)
    assert out.usage.completion_tokens == 3


def test_chat_streaming_with_usage(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=user("hi"), stream=True,
                                                 stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in content_chunks) == expected_text()
    assert [c.choices[0].finish_reason for c in content_chunks][-1] == "stop"
    assert all(c.choices[0].finish_reason is None for c in content_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == NUM_STOP_TOKENS
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 2


def test_raw_sse_framing(base_url):
    body = {"model": MODEL, "messages": user("hi"), "stream": True, "max_tokens": 2}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, headers=AUTH) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: {") for e in events[:-2])
    first = json.loads(events[0][len("data: "):])
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}]


def test_chat_n_with_seed(client, fake):
    out = client.chat.completions.create(model=MODEL, messages=user("hi"), n=2, seed=100)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.message.content for c in out.choices] == [expected_text(seed=100), expected_text(seed=101)]
    assert out.usage.completion_tokens == 2 * NUM_STOP_TOKENS
    children = fake.requests[-2:]
    assert sorted(r.request_id for r in children) == [f"{out.id}-0", f"{out.id}-1"]
    assert sorted(r.sampling.seed for r in children) == [100, 101] and all(r.sampling.n == 1 for r in children)


def test_chat_n_streaming(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=user("hi"), n=2, stream=True))
    texts, finishes = {0: "", 1: ""}, {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == {0: expected_text(), 1: expected_text()} and finishes == {0: "stop", 1: "stop"}


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=user("hi"), logprobs=True, top_logprobs=2,
                                         max_tokens=2)
    content = out.choices[0].logprobs.content
    assert [e.token for e in content] == [" w10", " w11"]
    assert content[0].logprob == -0.25 and content[0].bytes == list(b" w10")
    assert [(t.token, t.logprob) for t in content[1].top_logprobs] == [(" w11", -0.25), (" w12", -0.5)]
    chunks = list(client.chat.completions.create(model=MODEL, messages=user("hi"), logprobs=True, max_tokens=2,
                                                 stream=True))
    streamed = [e.token for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert streamed == [" w10", " w11"]


# -- completions and models --------------------------------------------------------------------------

def test_completions(client, fake):
    out = client.completions.create(model=MODEL, prompt="one two three")
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.choices[0].text == expected_text() and out.choices[0].finish_reason == "stop"
    assert out.usage.prompt_tokens == 3 and fake.requests[-1].sampling.max_tokens == 16
    out = client.completions.create(model=MODEL, prompt=[7, 8], max_tokens=2, logprobs=1)
    assert fake.requests[-1].prompt == [7, 8] and out.usage.prompt_tokens == 2
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].logprobs.tokens == [" w10", " w11"] and out.choices[0].logprobs.text_offset == [0, 4]
    assert out.choices[0].logprobs.top_logprobs[0] == {" w10": -0.25}


def test_completions_streaming(client):
    chunks = list(client.completions.create(model=MODEL, prompt="hi", stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected_text()
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 1 + NUM_STOP_TOKENS


def test_models(client, base_url):
    [card] = client.models.list().data
    assert (card.id, card.owned_by) == (MODEL, "epd") and card.model_extra["max_model_len"] == 4096
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


# -- errors -------------------------------------------------------------------------------------------

def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("content", [b"{not json", b'{"model": "x", '])
def test_malformed_json_is_400(base_url, content):
    response = httpx.post(f"{base_url}/v1/chat/completions", content=content,
                          headers={**AUTH, "content-type": "application/json"})
    error = error_of(response, 400)
    assert error["type"] == "invalid_request_error" and "Invalid JSON" in error["message"]


def test_body_that_is_not_a_json_object_is_400(base_url):
    for extra in [{"json": [1, 2]}, {"content": b'{"model": "m"}', "headers": {**AUTH, "content-type": "text/plain"}}]:
        response = httpx.post(f"{base_url}/v1/chat/completions", **{"headers": AUTH, **extra})
        assert "must be a JSON object" in error_of(response, 400)["message"]


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL, "messages": user("hi"), "temperature": "hot"}, "temperature"),
    ({"model": MODEL, "messages": user("hi"), "temperature": 3}, "temperature"),
    ({"model": MODEL}, "messages"),
    ({"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"model": MODEL, "messages": user("hi"), "top_logprobs": 2}, "top_logprobs"),
])
def test_schema_errors_are_400_not_422(base_url, body, param):
    error = error_of(httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=AUTH), 400)
    assert error["param"] == param and param in error["message"]


def test_openai_client_sees_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=user("hi"), n=17)
    assert info.value.body["param"] == "n"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}])
def test_api_key_required_on_v1(base_url, headers):
    for method, path in [("POST", "/v1/chat/completions"), ("GET", "/v1/models")]:
        response = httpx.request(method, f"{base_url}{path}", content=b"{bad", headers=headers)
        error = error_of(response, 401)
        assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    assert httpx.get(f"{base_url}/health").status_code == 200  # open, like vLLM
    assert httpx.get(f"{base_url}/metrics").status_code == 200


def test_unknown_model_is_404(base_url):
    body = {"model": "gpt-4", "messages": user("hi")}
    error = error_of(httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=AUTH), 404)
    assert (error["type"], error["code"], error["param"]) == ("not_found_error", "model_not_found", "model")


def test_unknown_route_and_wrong_method(base_url):
    assert error_of(httpx.get(f"{base_url}/v1/nothing", headers=AUTH), 404)["type"] == "not_found_error"
    response = httpx.get(f"{base_url}/v1/chat/completions", headers=AUTH)
    assert error_of(response, 405)["type"] == "invalid_request_error" and "POST" in response.headers["allow"]


@pytest.mark.parametrize("stream", [False, True])
def test_orchestrator_request_error_is_4xx_even_when_streaming(base_url, fake, stream):
    body = {"model": MODEL, "messages": user("a BAD prompt"), "n": 2, "stream": stream}
    error = error_of(httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=AUTH), 400)
    assert (error["message"], error["param"]) == ("the prompt is BAD", "messages")


def test_unhandled_error_is_500_and_server_keeps_serving(client, base_url):
    response = httpx.post(f"{base_url}/v1/completions", json={"model": MODEL, "prompt": "CRASH"}, headers=AUTH)
    error = error_of(response, 500)
    assert error["type"] == "server_error" and "secret" not in response.text and "Traceback" not in response.text
    assert response.headers["x-request-id"]
    assert client.completions.create(model=MODEL, prompt="fine").choices[0].text == expected_text()


def test_error_mid_stream_is_reported_in_band(base_url):
    body = {"model": MODEL, "prompt": "CRASHLATER", "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, headers=AUTH) as response:
        assert response.status_code == 200
        events = [e for e in response.read().decode().split("\n\n") if e]
    assert json.loads(events[-2][len("data: "):])["error"]["type"] == "server_error"
    assert events[-1] == "data: [DONE]" and "secret" not in "".join(events)


# -- request ids, health, metrics ------------------------------------------------------------------------

def test_x_request_id_is_echoed_or_generated(base_url):
    body = {"model": MODEL, "messages": user("hi")}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers={**AUTH, "x-request-id": "abc-1"})
    assert response.headers["x-request-id"] == "abc-1" and response.json()["id"].startswith("chatcmpl-")
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=AUTH)
    generated = response.headers["x-request-id"]
    assert len(generated) == 32 and response.json()["id"] == f"chatcmpl-{generated}"
    assert httpx.get(f"{base_url}/v1/models", headers={"x-request-id": "e-1"}).headers["x-request-id"] == "e-1"


def test_health_follows_the_orchestrator(base_url, fake):
    assert httpx.get(f"{base_url}/health").status_code == 200
    fake.healthy = False
    assert error_of(httpx.get(f"{base_url}/health"), 503)["type"] == "server_error"
    assert httpx.get(f"{base_url}/health").json()["missing_roles"] == ["decode"]


def test_metrics(client, base_url):
    client.chat.completions.create(model=MODEL, messages=user("hi"), stream=True).close()
    client.chat.completions.create(model=MODEL, messages=user("hi"))
    response = httpx.get(f"{base_url}/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    label = f'{{model_name="{MODEL}"}}'
    assert samples[f"epd:prompt_tokens_total{label}"] > 0
    assert samples[f"epd:generation_tokens_total{label}"] >= NUM_STOP_TOKENS
    assert samples[f'epd:request_success_total{{finished_reason="stop",model_name="{MODEL}"}}'] >= 1
    assert samples[f'epd:time_to_first_token_seconds_bucket{{le="+Inf",model_name="{MODEL}"}}'] >= 1
    assert samples[f"epd:inter_token_latency_seconds_count{label}"] >= NUM_STOP_TOKENS - 1
    assert samples[f"epd:e2e_request_latency_seconds_count{label}"] >= 1
    assert "epd:num_requests_running 0.0" in response.text  # the workers' part


# -- disconnects abort ------------------------------------------------------------------------------------

def test_client_disconnect_mid_stream_closes_the_orchestrator_stream(base_url, fake):
    body = {"model": MODEL, "messages": user("SLOW"), "stream": True, "n": 2}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, headers=AUTH) as response:
        lines = response.iter_lines()  # kept: a discarded iterator would close the connection early
        next(lines)
        rid = fake.requests[-1].request_id.rsplit("-", 1)[0]
        assert not {f"{rid}-0", f"{rid}-1"} & fake.closed
    assert wait_until(lambda: {f"{rid}-0", f"{rid}-1"} <= fake.closed)


def test_client_disconnect_while_waiting_non_streaming_closes_the_stream(base_url, fake):
    body = {"model": MODEL, "messages": user("SLOW")}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=AUTH, timeout=0.3)
    rid = fake.requests[-1].request_id
    assert wait_until(lambda: rid in fake.closed)


def test_the_light_bench_client_counts_streamed_tokens_and_failures(base_url):
    """bench/light_client.py (raw asyncio HTTP, keep-alive) against this app: 3 streams
    of 2 requests, 4 tokens each, counted from the usage chunks; a bad one named."""
    from epd.bench.light_client import completion_body, run_streams

    host, port = base_url.removeprefix("http://").split(":")
    good = completion_body(MODEL, "a b c", 4)
    bad = completion_body(MODEL, "a BAD prompt", 4)
    result = run_streams(host, int(port), "/v1/completions", [[good, good], [good, good], [good, bad]],
                         api_key=API_KEY)
    assert (result.num_requests, result.num_failed, result.num_output_tokens) == (6, 1, 5 * 4)
    assert "HTTP 400" in result.first_error and "BAD" in result.first_error


# -- the lean route against FastAPI's -----------------------------------------------------------

@pytest.fixture(scope="module")
def reference_url():
    """The same app with the two POST endpoints routed through FastAPI (`lean_routes=False`)."""
    yield from (url for url, _ in _serve_app(FakeOrchestrator(), lean_routes=False))


def _answer(response: httpx.Response):
    """What a client can see, less what differs by design between two answers (ids, times)."""
    def scrub(obj):
        return {k: scrub(v) for k, v in obj.items() if k not in ("id", "created")} if isinstance(obj, dict) else (
            [scrub(v) for v in obj] if isinstance(obj, list) else obj)
    body = response.content
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        body = [e if e == b"data: [DONE]" else scrub(json.loads(e[len(b"data: "):]))
                for e in body.split(b"\n\n") if e]
    elif body:
        body = scrub(json.loads(body))
    headers = {k: response.headers.get(k) for k in ("content-type", "content-length", "allow", "retry-after")}
    return response.status_code, body, headers, response.headers.get("x-request-id") == "rid-7"


JSON = {"content-type": "application/json"}
COMPLETION = {"model": MODEL, "prompt": "a b", "max_tokens": 3}
CHAT = {"model": MODEL, "messages": user("hi")}
LEAN_CASES = [  # (method, path, body bytes, extra headers)
    ("POST", "/v1/completions", json.dumps(COMPLETION).encode(), JSON),
    ("POST", "/v1/completions", json.dumps({**COMPLETION, "stream": True, "stream_options": {"include_usage": True},
                                            "logprobs": 1}).encode(), JSON),
    ("POST", "/v1/chat/completions", json.dumps({**CHAT, "n": 2, "seed": 3, "logprobs": True}).encode(), JSON),
    ("POST", "/v1/chat/completions", json.dumps({**CHAT, "stream": True, "n": 2}).encode(),
     {**JSON, "x-request-id": "rid-7"}),
    ("POST", "/v1/chat/completions", b'{"model": "qwen3-vl-test", "messages": [', JSON),  # bad JSON
    ("POST", "/v1/chat/completions", b"", JSON),  # no body
    ("POST", "/v1/chat/completions", json.dumps(CHAT).encode(), {}),  # no content type
    ("POST", "/v1/chat/completions", json.dumps(CHAT).encode(), {"content-type": "text/plain"}),
    ("POST", "/v1/chat/completions", json.dumps(CHAT).encode(), {"content-type": "application/x+json; charset=utf-8"}),
    ("POST", "/v1/completions", b"[1, 2]", JSON),
    ("POST", "/v1/completions", b'"text"', JSON),
    ("POST", "/v1/completions", b'{"model": "qwen3-vl-test", "prompt": "\xff"}', JSON),  # not UTF-8
    ("POST", "/v1/completions", b"[" * 100_000, JSON),  # nested past the parser's depth
    ("POST", "/v1/completions", json.dumps({"model": MODEL}).encode(), JSON),
    ("POST", "/v1/completions", b'{"model": "qwen3-vl-test", "prompt": "x", "temperature": NaN}', JSON),
    ("POST", "/v1/completions", json.dumps({**COMPLETION, "temperature": "hot"}).encode(), JSON),
    ("POST", "/v1/completions", json.dumps({**COMPLETION, "prompt": [1, -2]}).encode(), JSON),
    ("POST", "/v1/completions", json.dumps({**COMPLETION, "prompt": [5000]}).encode(), JSON),  # past the vocab
    ("POST", "/v1/chat/completions", json.dumps({**CHAT, "n": 0}).encode(), JSON),
    ("POST", "/v1/chat/completions", json.dumps({**CHAT, "messages": [{"role": "wizard"}]}).encode(), JSON),
    ("POST", "/v1/chat/completions", json.dumps({**CHAT, "model": "other"}).encode(), JSON),  # 404
    ("POST", "/v1/chat/completions", json.dumps({**CHAT, "messages": user("BAD")}).encode(), JSON),
    ("POST", "/v1/chat/completions", json.dumps({**CHAT, "messages": user("CRASH"), "stream": True}).encode(), JSON),
    ("POST", "/v1/completions", json.dumps({**COMPLETION, "prompt": "CRASHLATER", "stream": True}).encode(), JSON),
    ("GET", "/v1/completions", b"", {}),  # 405, through FastAPI on both
]


@pytest.mark.parametrize("auth", [True, False])
def test_lean_route_answers_as_fastapi_does(base_url, reference_url, auth):
    """Every case, good and bad, gets the same status, headers and body (less ids and
    times) from the lean route as from FastAPI's routing of the same endpoints."""
    cases = LEAN_CASES if auth else LEAN_CASES[:1]  # without the key: the 401, once
    with httpx.Client(timeout=10) as http:
        for method, path, body, headers in cases:
            headers = {**headers, **(AUTH if auth else {})}
            answers = [_answer(http.request(method, url + path, content=body, headers=headers))
                       for url in (base_url, reference_url)]
            assert answers[0] == answers[1], (method, path, body[:80])
            assert answers[0][0] in (200, 400, 401, 404, 405, 500), answers[0]


# -- the body cap ----------------------------------------------------------------------------------

SMALL_CAP = 4096


@pytest.fixture(scope="module", params=[True, False], ids=["lean", "fastapi"])
def capped_url(request):
    """Both routes behind a 4 KiB --max-request-body-mb: the cap is the middleware's, not the route's."""
    yield from (url for url, _ in _serve_app(FakeOrchestrator(), lean_routes=request.param,
                                              max_body_bytes=SMALL_CAP))


def test_a_body_past_the_cap_is_a_413_on_every_route(capped_url):
    big = json.dumps({**CHAT, "messages": user("word " * SMALL_CAP)}).encode()

    def chunked():  # no Content-Length: cut off by counting
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]

    with httpx.Client(timeout=10, headers={**AUTH, **JSON}) as http:
        for content in (big, chunked()):
            r = http.post(capped_url + "/v1/chat/completions", content=content)
            assert r.status_code == 413, r.text
            assert r.json()["error"]["code"] == "request_too_large" and r.headers["connection"] == "close"
        assert http.post(capped_url + "/v1/completions", content=b"x" * (SMALL_CAP + 1)).status_code == 413
        small = http.post(capped_url + "/v1/chat/completions", content=json.dumps(CHAT).encode())
        assert small.status_code == 200, small.text



def test_metrics_require_key_puts_metrics_behind_the_key():
    for url, _ in _serve_app(FakeOrchestrator(), metrics_require_key=True):
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert httpx.get(f"{url}/metrics", headers=AUTH).status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200


def test_metrics_name_no_host_or_port_of_a_worker():
    from epd.serve.worker_metrics import metrics_worker_name

    assert metrics_worker_name("decode-0") == "decode-0"
    name = metrics_worker_name("encoder@hostb.example:7000")
    assert name.startswith("encoder@") and "hostb" not in name and "7000" not in name
    assert name != metrics_worker_name("encoder@hostc.example:7000")


# -- vLLM's front-end flags (--max-logprobs, CORS, --enable-log-requests) -----------------------------------------

@pytest.mark.parametrize("lean_routes", [True, False])
def test_max_logprobs_caps_what_a_request_may_ask(lean_routes):
    for url, _ in _serve_app(FakeOrchestrator(), lean_routes=lean_routes, max_logprobs=2):
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True}
        ok = httpx.post(f"{url}/v1/chat/completions", json={**chat, "top_logprobs": 2}, headers=AUTH)
        assert ok.status_code == 200, ok.text
        too_many = httpx.post(f"{url}/v1/chat/completions", json={**chat, "top_logprobs": 3}, headers=AUTH)
        assert too_many.status_code == 400
        assert too_many.json()["error"]["param"] == "top_logprobs"
        assert "--max-logprobs 2" in too_many.json()["error"]["message"]
        completion = {"model": MODEL, "prompt": "hi", "logprobs": 3}
        refused = httpx.post(f"{url}/v1/completions", json=completion, headers=AUTH)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "logprobs"


@pytest.mark.parametrize("lean_routes", [True, False])
def test_allowed_origins_answer_cors_on_every_route(lean_routes):
    origin = {"origin": "https://app.example"}
    for url, _ in _serve_app(FakeOrchestrator(), lean_routes=lean_routes, allowed_origins=("https://app.example",)):
        preflight = httpx.options(f"{url}/v1/chat/completions", headers={
            **origin, "access-control-request-method": "POST", "access-control-request-headers": "authorization"})
        assert preflight.status_code == 200  # answered before the API key is asked
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        answer = httpx.post(f"{url}/v1/chat/completions", json=chat, headers={**AUTH, **origin})
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == "https://app.example"
        assert httpx.get(f"{url}/v1/models", headers={**AUTH, **origin}).headers[
            "access-control-allow-origin"] == "https://app.example"
        other = httpx.get(f"{url}/v1/models", headers={**AUTH, "origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers


def test_no_allowed_origins_no_cors_headers(base_url):
    answer = httpx.get(f"{base_url}/v1/models", headers={**AUTH, "origin": "https://app.example"})
    assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


def test_enable_log_requests_logs_one_line_per_request(caplog):
    import logging

    for url, _ in _serve_app(FakeOrchestrator(), log_requests=True):
        logging.getLogger("epd.requests").propagate = True  # to caplog (the app gave it its own handler)
        with caplog.at_level(logging.INFO, logger="epd.requests"):
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0.5}
            assert httpx.post(f"{url}/v1/chat/completions", json=chat, headers=AUTH).status_code == 200
        [line] = [r.getMessage() for r in caplog.records if r.name == "epd.requests"]
        assert line.startswith("request chatcmpl-") and "messages 1" in line and "temperature=0.5" in line


# -- /tokenize, /detokenize, /version, /v1/models/{id} ------------------------------------------------------------

def test_tokenize_a_prompt(base_url, fake):
    r = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "prompt": "one two three"}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json() == {"count": 4, "max_model_len": 4096, "tokens": [100, 101, 102, 1], "token_strs": None}
    r = httpx.post(f"{base_url}/tokenize", json={"prompt": "one two", "add_special_tokens": False,
                                                 "return_token_strs": True}, headers=AUTH)  # model: optional
    assert r.json() == {"count": 2, "max_model_len": 4096, "tokens": [100, 101], "token_strs": ["w100", "w101"]}
    assert httpx.post(f"{base_url}/tokenize", json={"prompt": ""}, headers=AUTH).json()["tokens"] == []


def test_tokenize_a_chat_counts_what_the_chat_costs(client, base_url, fake):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "what is this"}]}]
    r = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "messages": messages}, headers=AUTH)
    assert r.status_code == 200, r.text
    request = fake.requests[-1]
    assert (request.prompt, request.add_generation_prompt) == (None, True)
    usage = client.chat.completions.create(model=MODEL, messages=messages).usage
    assert r.json()["count"] == usage.prompt_tokens == len(r.json()["tokens"])
    r = httpx.post(f"{base_url}/tokenize", json={"messages": messages, "add_generation_prompt": False}, headers=AUTH)
    assert r.status_code == 200 and fake.requests[-1].add_generation_prompt is False


@pytest.mark.parametrize("body, status, param", [
    ({"model": "other", "prompt": "x"}, 404, "model"),
    ({"prompt": 3}, 400, "prompt"),
    ({"prompt": "BAD"}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"a": 1}}, 400, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, 400, "continue_final_message"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web"}]}, 400, "tools[0].type"),
])
def test_tokenize_refuses_bad_input_with_an_openai_error(base_url, body, status, param):
    r = httpx.post(f"{base_url}/tokenize", json=body, headers=AUTH)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_tokenize_bodies_that_are_not_json_objects(base_url):
    for content in (b"{not json", b"[1, 2]"):
        r = httpx.post(f"{base_url}/tokenize", content=content, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["message"], r.text


def test_tokenize_bodies_are_bounded_as_generation_bodies_are(base_url):
    from epd.api.generate_route import max_json_items

    items = max_json_items(FakeOrchestrator.max_model_len)
    body = b'{"prompt": "x", "pad": [' + b"0," * items + b'0]}'
    r = httpx.post(f"{base_url}/tokenize", content=body, headers=AUTH)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_detokenize(base_url):
    r = httpx.post(f"{base_url}/detokenize", json={"model": MODEL, "tokens": [5, 6]}, headers=AUTH)
    assert r.status_code == 200 and r.json() == {"prompt": " w5 w6"}
    for tokens, message in (([5, 1000], "token id 1000 is outside the vocabulary [0, 1000)"),
                            ([-1], "greater than or equal to 0")):
        r = httpx.post(f"{base_url}/detokenize", json={"tokens": tokens}, headers=AUTH)
        assert r.status_code == 400 and message in r.json()["error"]["message"]
        assert r.json()["error"]["param"].startswith("tokens")
    r = httpx.post(f"{base_url}/detokenize", json={"model": MODEL}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["message"] == "tokens: field required"


def test_tokenizer_endpoints_need_the_key_and_version_does_not(base_url):
    from epd import __version__

    assert httpx.post(f"{base_url}/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.post(f"{base_url}/detokenize", json={"tokens": [1]}).status_code == 401
    r = httpx.get(f"{base_url}/version")
    assert r.status_code == 200 and r.json() == {"version": __version__}


def test_a_path_model_id_is_retrieved_as_listed():
    """`epd serve ./ckpt` lists the id "./ckpt": the official client sends it percent-encoded,
    plain HTTP clients resolve its dot segment; both find the model, another name does not."""
    for served in ("./ckpt", "/models/Qwen3-VL-4B.v2"):
        for url, _ in _serve_app(FakeOrchestrator(), served_model_name=served):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
            [listed] = client.models.list().data
            assert listed.id == served and client.models.retrieve(listed.id).id == served
            plain = httpx.get(f"{url}/v1/models/{served}", headers=AUTH)
            assert plain.status_code == 200 and plain.json()["id"] == served
            with pytest.raises(openai.NotFoundError):
                client.models.retrieve("./other")
