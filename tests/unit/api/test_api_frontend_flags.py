"""vLLM's front-end flags: --max-logprobs, CORS origins, --enable-log-requests.

The app runs under a real uvicorn in this process, in front of
tests/testkit/fake_api.py's `FakeOrchestrator` (what its prompts steer is said there)."""
from __future__ import annotations

import httpx
import pytest
from testkit.fake_api import AUTH, FakeOrchestrator, MODEL, serve_app


@pytest.mark.parametrize("lean_routes", [True, False])
def test_max_logprobs_caps_what_a_request_may_ask(lean_routes):
    for url, _ in serve_app(FakeOrchestrator(), lean_routes=lean_routes, max_logprobs=2):
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
    for url, _ in serve_app(FakeOrchestrator(), lean_routes=lean_routes, allowed_origins=("https://app.example",)):
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

    for url, _ in serve_app(FakeOrchestrator(), log_requests=True):
        logging.getLogger("epd.requests").propagate = True  # to caplog (the app gave it its own handler)
        with caplog.at_level(logging.INFO, logger="epd.requests"):
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0.5}
            assert httpx.post(f"{url}/v1/chat/completions", json=chat, headers=AUTH).status_code == 200
        [line] = [r.getMessage() for r in caplog.records if r.name == "epd.requests"]
        assert line.startswith("request chatcmpl-") and "messages 1" in line and "temperature=0.5" in line
