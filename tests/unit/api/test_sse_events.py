"""`delta_event`: a plain text delta is written from a template made once per
choice; the bytes must be exactly those of the general path, `sse(delta_chunk)`."""
from __future__ import annotations

import json

import pytest

from epd.api.completions_format import ChatFormat, CompletionFormat, sse
from epd.api.protocol import Delta
from epd.api.tool_calls import ToolChoice
from epd.transport.wire.sampling import TokenLogprobs

TEXTS = [" hello", 'a "quoted" \\ back\nslash', "é中文🙂", "\u0000\u001f control", "@@epd-text@@"]


def _formats():
    decode = lambda t: f"<{t}>"  # noqa: E731
    return [ChatFormat("chatcmpl-1", 'model "x"', 1700000000, decode, False),
            ChatFormat("chatcmpl-2", "m", 1, decode, True),  # logprobs: the general path
            ChatFormat("chatcmpl-3", "m", 1, decode, False, tool_choice=ToolChoice("auto")),
            CompletionFormat("cmpl-1", "m/é", 1700000000, decode, False),
            CompletionFormat("cmpl-2", "m", 1, decode, True)]


@pytest.mark.parametrize("index", [0, 3])
def test_text_events_are_the_bytes_of_the_general_path(index):
    for fmt, reference in zip(_formats(), _formats()):  # twins: formats keep per-choice state
        for i, text in enumerate(TEXTS):
            finish = "length" if i == len(TEXTS) - 1 else None
            logprobs = [TokenLogprobs(5 + i, -0.25, 1, [(6, -1.0)])] if fmt.want_logprobs else None
            delta = Delta(text, [5 + i], finish, 3, 0, logprobs)
            chunk = reference.delta_chunk(index, delta)
            expected = sse(chunk) if chunk is not None else None
            assert fmt.delta_event(index, delta) == expected
            if expected is not None:
                json.loads(expected[len(b"data: "):])  # a well-formed event


def test_an_empty_delta_sends_nothing():
    for fmt in _formats():
        if not fmt.want_logprobs:
            assert fmt.delta_event(0, Delta("", [7], None, 3, 0)) is None


def test_the_chat_role_chunk_carries_the_prompt_ids_and_usage_as_vllms():
    from epd.api.completions_format import Extras

    first = Delta("a", [5], None, 7, 0, prompt_token_ids=[1, 2, 3, 4, 5, 6, 7])
    fmt = ChatFormat("chatcmpl-1", "m", 1, str, False, Extras(return_token_ids=True, continuous_usage=True))
    [role] = fmt.opening_chunks(0, first)
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["prompt_token_ids"] == first.prompt_token_ids
    assert role["usage"] == {"prompt_tokens": 7, "completion_tokens": 0, "total_tokens": 7}
    assert "prompt_token_ids" not in fmt.delta_chunk(0, first)  # on the role chunk only
    plain = ChatFormat("chatcmpl-2", "m", 1, str, False).opening_chunks(0, first)
    assert "usage" not in plain[0] and "prompt_token_ids" not in plain[0]


def test_echo_with_max_tokens_zero_shows_the_prompt_alone():
    from epd.api.completions_format import Extras, SequenceOutput

    fmt = CompletionFormat("cmpl-1", "m", 1, lambda t: f"<{t}>", True, Extras(echo=("Hi there",), echo_only=True,
                                                                        echo_logprobs=True))
    delta = Delta("x", [9], "length", 2, 0, [TokenLogprobs(9, -0.5, 1, [])], prompt_token_ids=[3, 4],
                  prompt_logprobs=[TokenLogprobs(4, -1.0, 1, [])])
    output = SequenceOutput(0)
    output.add(delta)
    [choice] = fmt.response([output])["choices"]
    assert choice["text"] == "Hi there" and choice["logprobs"]["tokens"] == ["<3>", "<4>"]
    streamed = CompletionFormat("cmpl-2", "m", 1, lambda t: f"<{t}>", True, fmt.extras).delta_chunk(0, delta)
    assert streamed["choices"][0]["text"] == "Hi there"
    assert streamed["choices"][0]["logprobs"]["tokens"] == ["<3>", "<4>"]
