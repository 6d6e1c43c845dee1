"""Request ids, health, metrics, and a client that goes away mid-request.

The app runs under a real uvicorn in this process, in front of
tests/testkit/fake_api.py's `FakeOrchestrator` (what its prompts steer is said there)."""
from __future__ import annotations

import httpx
import pytest
from testkit.fake_api import (API_KEY, AUTH, error_of, FakeOrchestrator, MODEL, NUM_STOP_TOKENS, serve_app, user,
                             wait_until)


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
    """bench/dev/light_client.py (raw asyncio HTTP, keep-alive) against this app: 3 streams
    of 2 requests, 4 tokens each, counted from the usage chunks; a bad one named."""
    from bench.dev.light_client import completion_body, run_streams

    host, port = base_url.removeprefix("http://").split(":")
    good = completion_body(MODEL, "a b c", 4)
    bad = completion_body(MODEL, "a BAD prompt", 4)
    result = run_streams(host, int(port), "/v1/completions", [[good, good], [good, good], [good, bad]],
                         api_key=API_KEY)
    assert (result.num_requests, result.num_failed, result.num_output_tokens) == (6, 1, 5 * 4)
    assert "HTTP 400" in result.first_error and "BAD" in result.first_error


def test_metrics_require_key_puts_metrics_behind_the_key():
    for url, _ in serve_app(FakeOrchestrator(), metrics_require_key=True):
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert httpx.get(f"{url}/metrics", headers=AUTH).status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200


def test_metrics_name_no_host_or_port_of_a_worker():
    from epd.serve.worker_metrics import metrics_worker_name

    assert metrics_worker_name("decode-0") == "decode-0"
    name = metrics_worker_name("encoder@hostb.example:7000")
    assert name.startswith("encoder@") and "hostb" not in name and "7000" not in name
    assert name != metrics_worker_name("encoder@hostc.example:7000")
