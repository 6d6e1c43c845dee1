"""Structured outputs, tool calls and logits controls through `epd serve` with the
official `openai` client, in every mode (the shared server of each mode, few KV
blocks so concurrent requests preempt): a random-weight model's output is valid because
the constraint alone makes it so, including across the e-p-d hand-over."""
from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import openai
import pytest
from testkit.media import image_bytes, image_part
from testkit.mode_servers import SERVED_MODEL
from pydantic import BaseModel, Field
from testkit.schemas import Invoice

MODEL = SERVED_MODEL
IMG = image_bytes(64, 48, seed=5)
IMAGE = [{"role": "user", "content": [image_part(IMG), {"type": "text", "text": "Read the invoice."}]}]
TEXT = [{"role": "user", "content": "What is the weather in Paris?"}]


def long_prompt(i: int) -> list[dict]:
    """~250 tokens, distinct from the first block on (no prefix-cache sharing between jobs)."""
    return [{"role": "system", "content": f"Job {i}. " + "Describe this image in detail. " * 14}] + TEXT


class Weather(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    days: int = Field(ge=1, le=7)


class Time(BaseModel):
    zone: Literal["UTC", "CET"]


WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
ARGS = {"get_weather": Weather, "get_time": Time}
REGEX = r"[0-9]{3}-[a-z]{2}"
LONG_REGEX = r"([a-z]{2} ){50}"  # a long output of known shape: KV pressure


@pytest.fixture(scope="module")
def server(mode_server):
    """The mode's shared server (tests/e2e/conftest.py): 56 KV blocks of 16 tokens, so a
    prompt with tools (~700 tokens) fits and eight concurrent requests with a long system
    prompt preempt each other."""
    return mode_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _stream_text(client, **kwargs) -> tuple[str, str]:
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)


def _text(client, stream: bool, **kwargs) -> tuple[str, str]:
    if stream:
        return _stream_text(client, **kwargs)
    choice = client.chat.completions.create(model=MODEL, **kwargs).choices[0]
    return choice.message.content, choice.finish_reason


def test_parse_returns_a_pydantic_object_for_an_image_prompt(client):
    completion = client.beta.chat.completions.parse(model=MODEL, messages=IMAGE, response_format=Invoice,
                                                    temperature=0, max_tokens=120)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Invoice)


def test_constraints_hold_streamed_and_not_under_preemption(client, server, tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    ends = {str(tokenizer.convert_tokens_to_ids(c)): 20.0 for c in ('"', "}")}  # end the random strings
    schema = {"type": "json_schema", "json_schema": {"name": "invoice", "schema": Invoice.model_json_schema(),
                                                     "strict": True}}
    cases = [("schema", dict(response_format=schema, max_tokens=120)),
             ("schema", dict(response_format=schema, max_tokens=120)),
             ("object", dict(response_format={"type": "json_object"}, logit_bias=ends, max_tokens=60)),
             ("choice", dict(extra_body={"structured_outputs": {"choice": ["cat", "dog"]}}, max_tokens=10)),
             ("regex", dict(extra_body={"structured_outputs": {"regex": REGEX}}, max_tokens=10)),
             ("long", dict(extra_body={"structured_outputs": {"regex": LONG_REGEX}}, max_tokens=160))]
    # text only: a decode worker preempting an image request could not recompute it (it holds no embeddings)
    jobs = [(kind, stream, dict(kwargs, messages=long_prompt(i), temperature=1.0, seed=i))
            for i, (stream, (kind, kwargs)) in enumerate((s, c) for s in (False, True) for c in cases)]
    before = server.metric_sum("epd:num_preemptions_total")
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: (job[0], *_text(client, job[1], **job[2])), jobs))
    deadline = time.monotonic() + 10  # workers publish their counters every few hundred ms
    while server.metric_sum("epd:num_preemptions_total") <= before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.metric_sum("epd:num_preemptions_total") > before
    checks = {"schema": Invoice.model_validate_json, "object": lambda t: isinstance(json.loads(t), dict) or 1 / 0,
              "choice": lambda t: t in ("cat", "dog") or 1 / 0, "regex": lambda t: re.fullmatch(REGEX, t) or 1 / 0,
              "long": lambda t: re.fullmatch(LONG_REGEX, t) or 1 / 0}
    stopped = [(kind, text) for kind, text, finish in results if finish == "stop"]
    assert len(stopped) >= len(jobs) - 2, results
    for kind, text in stopped:
        checks[kind](text)


def _tool_calls(client, stream: bool, **kwargs) -> tuple[list[tuple[str, str]], str | None, str]:
    """[(name, arguments)], content, finish_reason; streamed deltas concatenated by index."""
    kwargs = dict(dict(model=MODEL, messages=TEXT, tools=TOOLS, temperature=0, max_tokens=60), **kwargs)
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return calls, choice.message.content, choice.finish_reason
    calls: dict[int, list[str]] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, ["", ""])
            if call.id is not None:
                assert call.type == "function" and call.id.startswith("call_")
            entry[0] += call.function.name or ""
            entry[1] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return [tuple(calls[i]) for i in sorted(calls)], content or None, finish


@pytest.mark.parametrize("tool_choice, finish", [
    ({"type": "function", "function": {"name": "get_weather"}}, "stop"), ("required", "tool_calls")])
def test_named_and_required_tool_calls_validate_and_stream_the_same(client, tool_choice, finish):
    calls, content, reason = _tool_calls(client, False, tool_choice=tool_choice)
    assert reason == finish and content is None and calls
    for name, arguments in calls:
        ARGS[name].model_validate_json(arguments)
    if tool_choice != "required":
        assert [name for name, _ in calls] == ["get_weather"]
    assert _tool_calls(client, True, tool_choice=tool_choice) == (calls, content, reason)


def test_auto_parses_a_hermes_block_and_a_follow_up_renders(client, server, tiny_model):
    # a test-only constraint makes the random model write Qwen's <tool_call> block
    block = r'Let me check\.<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}\n</tool_call>'
    body = dict(tool_choice="auto", max_tokens=120, extra_body={"structured_outputs": {"regex": block}})
    calls, content, reason = _tool_calls(client, False, **body)
    assert reason == "tool_calls" and content == "Let me check."
    [(name, arguments)] = calls
    assert name == "get_weather"
    Weather.model_validate_json(arguments)
    assert _tool_calls(client, True, **body) == (calls, content, reason)

    from transformers import AutoTokenizer

    follow_up = TEXT + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]
    completion = client.chat.completions.create(model=MODEL, messages=follow_up, tools=TOOLS, max_tokens=2)
    template = [TEXT[0], {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": json.loads(arguments)}}]},
        {"role": "tool", "content": "Sunny, 21 C"}]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    text = tokenizer.apply_chat_template(template, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in text and "<tools>\n{" in text
    assert completion.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format.json_schema.schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"logit_bias": {"999999": 5}}, "logit_bias"),
    ({"allowed_token_ids": [10**7]}, "allowed_token_ids"),
])
def test_bad_constraints_are_400_and_the_server_keeps_serving(server, fields, param):
    body = {"model": MODEL, "messages": TEXT, "max_tokens": 2, **fields}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    ok = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                    json={"model": MODEL, "messages": TEXT, "max_tokens": 8,
                          "structured_outputs": {"choice": ["yes", "no"]}})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] in ("yes", "no")
