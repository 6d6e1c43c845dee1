"""POST /v1/responses (OpenAI's Responses API, stateless) through a real `epd serve`
and the official `openai` client, unchanged: greedy text and images give the chat
path's text and `responses.stream` folds the events into the same response, in every
mode (the shared server of each); on the e-pd one, `text.format` is held by the
grammar engine, logprobs come with the text and refusals are OpenAI 400s."""
from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from testkit.api_checks import assert_error
from testkit.media import data_url, image_bytes, image_part
from testkit.mode_servers import MODES, SERVED_MODEL

EVERY_MODE = pytest.mark.parametrize("mode_server", MODES, indirect=True)
E_PD = pytest.mark.parametrize("mode_server", ["e-pd"], indirect=True)  # one server is enough

MODEL = SERVED_MODEL
NUM_TOKENS = 12
PROMPT = "Tell me a story about a lighthouse."
IMG = image_bytes(64, 40, seed=21)


class Weather(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    days: int = Field(ge=1, le=7)


@pytest.fixture(scope="module")
def client(mode_server) -> openai.OpenAI:
    """The official client of the mode's shared server (tests/e2e/conftest.py)."""
    return openai.OpenAI(base_url=mode_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, messages: list[dict], **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NUM_TOKENS, temperature=0,
                                          **kwargs)


def respond(client, input, **kwargs):
    kwargs = {"max_output_tokens": NUM_TOKENS, "temperature": 0, **kwargs}
    return client.responses.create(model=MODEL, input=input, **kwargs)


def assert_same_answer(response, completion) -> None:
    """The response says what the chat completion of the same prompt said, in its own words."""
    choice = completion.choices[0]
    assert response.output_text == choice.message.content
    assert response.object == "response" and response.id.startswith("resp_") and response.model == MODEL
    assert [(item.type, item.role, [part.type for part in item.content]) for item in response.output] == \
        [("message", "assistant", ["output_text"])]
    assert response.usage.input_tokens == completion.usage.prompt_tokens
    assert response.usage.output_tokens == completion.usage.completion_tokens
    assert response.usage.total_tokens == completion.usage.total_tokens
    if choice.finish_reason == "length":
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed" and response.incomplete_details is None


@EVERY_MODE
def test_text_input_gives_the_chat_text(client):
    response = respond(client, PROMPT, store=True)  # store is accepted (nothing is stored, as vLLM)
    assert_same_answer(response, chat(client, [{"role": "user", "content": PROMPT}]))
    assert response.max_output_tokens == NUM_TOKENS and response.temperature == 0.0
    unnamed = client.responses.create(input=PROMPT, max_output_tokens=NUM_TOKENS, temperature=0)  # as vLLM: optional
    assert (unnamed.model, unnamed.output_text) == (MODEL, response.output_text)


@E_PD
def test_instructions_and_parts_are_the_chat_messages(client):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hello."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi there."}]},
             {"role": "user", "content": PROMPT}]
    response = respond(client, items, instructions="Answer like a sailor.")
    messages = [{"role": "system", "content": "Answer like a sailor."},
                {"role": "user", "content": [{"type": "text", "text": "Hello."}]},
                {"role": "assistant", "content": [{"type": "text", "text": "Hi there."}]},
                {"role": "user", "content": PROMPT}]
    assert_same_answer(response, chat(client, messages))
    assert response.instructions == "Answer like a sailor."


@EVERY_MODE
def test_image_input_gives_the_chat_text(client):
    items = [{"role": "user", "content": [{"type": "input_image", "image_url": data_url(IMG), "detail": "auto"},
                                          {"type": "input_text", "text": "What is this?"}]}]
    response = respond(client, items)
    completion = chat(client, [{"role": "user", "content": [image_part(IMG), {"type": "text", "text": "What is this?"}]}])
    assert_same_answer(response, completion)
    assert response.usage.input_tokens > respond(client, "What is this?").usage.input_tokens  # the image counted


@E_PD
def test_logprobs_come_with_the_text(client):
    response = respond(client, PROMPT, include=["message.output_text.logprobs"], top_logprobs=2)
    logprobs = response.output[0].content[0].logprobs
    assert len(logprobs) == response.usage.output_tokens
    assert "".join(entry.token for entry in logprobs) == response.output_text
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in logprobs)


@EVERY_MODE
@pytest.mark.parametrize("input", [PROMPT, "image"])
def test_stream_folds_into_the_same_response(client, input):
    if input == "image":
        input = [{"role": "user", "content": [{"type": "input_image", "image_url": data_url(IMG)},
                                              {"type": "input_text", "text": "Describe it."}]}]
    expected = respond(client, input)
    with client.responses.stream(model=MODEL, input=input, max_output_tokens=NUM_TOKENS, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == events[-4].text == final.output_text == expected.output_text
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    assert (final.status, final.usage.output_tokens) == (expected.status, expected.usage.output_tokens)


@E_PD
def test_stream_ends_with_the_completed_event_and_no_done_marker(mode_server):
    body = {"model": MODEL, "input": PROMPT, "max_output_tokens": 3, "stream": True}
    response = httpx.post(mode_server.base_url + "/v1/responses", json=body, timeout=120)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    frames = response.text.strip().split("\n\n")
    assert "[DONE]" not in response.text
    for frame in frames:  # each event named on its own line, as OpenAI frames them
        event, data = frame.split("\n")
        assert event == "event: " + json.loads(data.removeprefix("data: "))["type"]
    assert frames[-1].startswith("event: response.completed\n")


@E_PD
def test_text_format_json_schema_is_held_by_the_grammar(client):
    response = client.responses.create(
        model=MODEL, input="The weather?", max_output_tokens=60, temperature=0,
        text={"format": {"type": "json_schema", "name": "weather", "schema": Weather.model_json_schema(),
                         "strict": True}})
    assert response.status == "completed"
    Weather.model_validate_json(response.output_text)
    parsed = client.responses.parse(model=MODEL, input="The weather?", max_output_tokens=60, temperature=1.0,
                                    text_format=Weather)
    assert isinstance(parsed.output_parsed, Weather)


@E_PD
@pytest.mark.parametrize("fields, param", [
    ({"background": True}, "background"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}, "tools"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]},
     "input[0].content[0].file_id"),
    ({"input": [{"role": "assistant", "content": [{"type": "input_image", "image_url": "http://x/a.png"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "input[0].content[0].type"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "nonsense"}}}},
     "text.format.schema"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": []}, "input"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_refusals_are_openai_400s(mode_server, fields, param):
    body = {"model": MODEL, "input": PROMPT, "max_output_tokens": 2, **fields}
    assert_error(httpx.post(mode_server.base_url + "/v1/responses", json=body, timeout=60), 400, param=param)


@E_PD
def test_unknown_model_is_a_404_and_the_server_keeps_serving(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-4o", input=PROMPT)
    assert respond(client, PROMPT).output_text == respond(client, PROMPT).output_text
