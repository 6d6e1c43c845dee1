"""The lean generation route answers as the FastAPI route does, and the body cap holds on both.

The app runs under a real uvicorn in this process, in front of
tests/testkit/fake_api.py's `FakeOrchestrator` (what its prompts steer is said there)."""
from __future__ import annotations

import json

import httpx
import pytest
from testkit.fake_api import AUTH, CHAT, COMPLETION, FakeOrchestrator, JSON, MODEL, serve_app, user


# -- the lean route against FastAPI's -----------------------------------------------------------

@pytest.fixture(scope="module")
def reference_url():
    """The same app with the two POST endpoints routed through FastAPI (`lean_routes=False`)."""
    yield from (url for url, _ in serve_app(FakeOrchestrator(), lean_routes=False))


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
    yield from (url for url, _ in serve_app(FakeOrchestrator(), lean_routes=request.param,
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
