"""Bad requests and failures: OpenAI error bodies with the right status, in band when streaming.

The app runs under a real uvicorn in this process, in front of
tests/testkit/fake_api.py's `FakeOrchestrator` (what its prompts steer is said there)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from testkit.fake_api import API_KEY, AUTH, error_of, expected_text, MODEL, user


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
    ({"model": MODEL, "messages": [{"role": "", "content": "x"}]}, "messages[0].role"),
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
