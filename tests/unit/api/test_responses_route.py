"""POST /v1/responses at the HTTP edge (a real app and uvicorn in front of
tests/testkit/fake_api.py's FakeOrchestrator, the official client): the request
the orchestrator gets, the response object's fields, the stream's events, an error
mid-stream, the length running out, and errors named by the Responses fields."""
from __future__ import annotations

import json

import httpx
import pytest
from testkit.fake_api import AUTH, MODEL, NUM_STOP_TOKENS, expected_text


def events_of(text: str) -> list[dict]:
    """`event: T` / `data: {...}` frames -> their data, each checked to name its own type."""
    out = []
    for frame in text.strip().split("\n\n"):
        event, data = frame.split("\n")
        out.append(json.loads(data.removeprefix("data: ")))
        assert event == "event: " + out[-1]["type"]
    return out


def test_the_request_is_the_chat_request_it_means(client, fake):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "hello"},
                                          {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]},
             {"role": "developer", "content": "short answers"}]
    response = client.responses.create(model=MODEL, input=items, instructions="be brief", max_output_tokens=40,
                                       temperature=0.5, top_p=0.9, metadata={"k": "v"}, user="u1")
    request = fake.requests[-1]
    assert request.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "hi"}]},
        {"role": "system", "content": "short answers"}]
    assert (request.sampling.max_tokens, request.sampling.temperature, request.sampling.top_p) == (40, 0.5, 0.9)
    assert request.request_id == response.id and response.id.startswith("resp_")
    assert response.output_text == expected_text() and response.status == "completed" and response.error is None
    assert (response.instructions, response.metadata, response.user, response.max_output_tokens,
            response.temperature, response.top_p) == ("be brief", {"k": "v"}, "u1", 40, 0.5, 0.9)
    num_prompt = len(json.dumps(request.messages).split())  # what the fake counts
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens,
            response.usage.input_tokens_details.cached_tokens) == (num_prompt, NUM_STOP_TOKENS,
                                                                   num_prompt + NUM_STOP_TOKENS, 2)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_the_length_running_out_is_an_incomplete_response(client, stream):
    kwargs = dict(model=MODEL, input="hello", max_output_tokens=3)
    if stream:
        with client.responses.stream(**kwargs) as events:
            response = events.get_final_response()
    else:
        response = client.responses.create(**kwargs)
    assert response.output_text == expected_text(3) and response.usage.output_tokens == 3
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"


def test_stream_events_are_numbered_and_carry_logprobs(base_url):
    body = {"model": MODEL, "input": "hello", "stream": True, "include": ["message.output_text.logprobs"],
            "top_logprobs": 2}
    response = httpx.post(f"{base_url}/v1/responses", json=body, headers=AUTH)
    events = events_of(response.text)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [d["delta"] for d in deltas] == [f" w{10 + i}" for i in range(NUM_STOP_TOKENS)]
    assert [[t["token"] for t in d["logprobs"][0]["top_logprobs"]] for d in deltas] == \
        [[f" w{10 + i}", f" w{11 + i}"] for i in range(NUM_STOP_TOKENS)]
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and final["status"] == "completed"
    assert len(final["output"][0]["content"][0]["logprobs"]) == NUM_STOP_TOKENS
    assert {e.get("item_id") for e in events[2:-1]} - {None} == {final["output"][0]["id"]}


def test_an_error_mid_stream_ends_it_with_error_and_response_failed(base_url, client):
    body = {"model": MODEL, "input": "CRASHLATER", "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/responses", json=body, headers=AUTH) as response:
        assert response.status_code == 200
        text = response.read().decode()
    events = events_of(text)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "server_error" and "secret" not in text and "[DONE]" not in text
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert failed["output"][0]["content"][0]["text"] == expected_text(2)
    assert client.responses.create(model=MODEL, input="fine").output_text == expected_text()  # still serving


def test_an_aborted_request_ends_the_stream_with_response_failed(base_url):
    body = {"model": MODEL, "input": "ABORTLATER", "stream": True}
    events = events_of(httpx.post(f"{base_url}/v1/responses", json=body, headers=AUTH).text)
    assert events[-1]["type"] == "response.failed" and events[-1]["response"]["status"] == "failed"
    assert "response.completed" not in [e["type"] for e in events]
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == expected_text(2)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_prompt_errors_name_the_input(base_url, stream):
    """The orchestrator refuses the prompt (param "messages"): the client reads "input"."""
    body = {"model": MODEL, "input": [{"role": "user", "content": "BAD"}], "stream": stream}
    response = httpx.post(f"{base_url}/v1/responses", json=body, headers=AUTH)
    assert response.status_code == 400 and response.json()["error"]["param"] == "input"


def test_the_api_key_guards_the_route(base_url):
    response = httpx.post(f"{base_url}/v1/responses", json={"model": MODEL, "input": "hello"})
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


def test_responses_bodies_are_bounded_as_generation_bodies_are(base_url):
    """JSON items counted before the body is parsed (issue 33, item 1), as on the other routes."""
    from epd.api.generate_route import max_json_items
    from testkit.fake_api import FakeOrchestrator

    items = max_json_items(FakeOrchestrator.max_model_len)
    body = b'{"input": "x", "metadata": {"pad": [' + b"0," * items + b'0]}}'
    r = httpx.post(f"{base_url}/v1/responses", content=body, headers=AUTH)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    for content in (b"{not json", b"[1, 2]"):
        r = httpx.post(f"{base_url}/v1/responses", content=content, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["message"], r.text
    r = httpx.post(f"{base_url}/v1/responses", json={"model": MODEL, "input": 5}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
