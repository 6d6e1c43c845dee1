"""Chat completions, completions and the model list as the `openai` client and raw SSE see them.

The app runs under a real uvicorn in this process, in front of
tests/testkit/fake_api.py's `FakeOrchestrator` (what its prompts steer is said there)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from testkit.fake_api import AUTH, expected_text, MODEL, NUM_STOP_TOKENS, user


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
