"""`delta_event`: a plain text delta is written from a template made once per
choice; the bytes must be exactly those of the general path, `sse(delta_chunk)`."""
from __future__ import annotations

import json

import pytest

from epd.api.protocol import Delta
from epd.api.responses import ChatFormat, CompletionFormat, sse
from epd.api.tool_calls import ToolChoice
from epd.transport.sampling import TokenLogprobs

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
