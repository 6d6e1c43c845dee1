"""Tool calls at the API edge: tools and tool_choice checked, the constraint they
imply, and hermes output parsed the same whether fed whole or in any pieces."""
from __future__ import annotations

import json

import pytest

from epd.api.completions_format import ChatFormat, SequenceOutput
from epd.api.protocol import Delta, RequestError, parse_chat_request
from epd.api.tool_calls import ToolCallParser, ToolChoice, parse_tool_choice, tool_choice_schema, validate_tools

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = validate_tools([{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
                        {"type": "function", "function": {"name": "get_time"}}])
AUTO = ToolChoice("auto")
HERMES = ('Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def _feed(choice: ToolChoice, pieces: list[str]) -> tuple[str, list[dict]]:
    """Content and calls (deltas merged by index, as a client does)."""
    parser = ToolCallParser(choice)
    content, calls = "", {}
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    for d in deltas:
        content += d.content
        for call in d.tool_calls:
            entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
            entry["name"] += call["function"].get("name") or ""
            entry["arguments"] += call["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(HERMES)])
def test_hermes_output_parses_the_same_in_any_pieces(size):
    pieces = [HERMES[i:i + size] for i in range(0, len(HERMES), size)]
    content, calls = _feed(AUTO, pieces)
    assert content == "Sure."
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}'},
                     {"name": "get_time", "arguments": "{}"}]


def test_text_that_only_looks_like_a_tool_call_start_is_content():
    assert _feed(AUTO, ["a <tool", "_cal", "l is not here"]) == ("a <tool_call is not here", [])
    assert _feed(AUTO, ["ends with <tool_"]) == ("ends with <tool_", [])
    assert _feed(ToolChoice("none"), [HERMES]) == (HERMES, [])


def test_an_unclosed_or_broken_block_at_the_end():
    content, calls = _feed(AUTO, ['x<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}'])
    assert content == "x" and calls == [{"name": "get_time", "arguments": '{"zone": "UTC"}'}]
    assert _feed(AUTO, ["x<tool_call>{not json</tool_call>"]) == ("x", [])


def test_required_and_named():
    required = json.dumps([{"name": "get_weather", "parameters": {"city": "Oslo"}}])
    assert _feed(ToolChoice("required"), [required[:5], required[5:]]) == (
        "", [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}])
    assert _feed(ToolChoice("required"), ['[{"name": "get_w']) == ('[{"name": "get_w', [])  # cut short
    named = ToolChoice("named", "get_weather")
    assert _feed(named, ['{"city"', ': "Rome"}']) == ("", [{"name": "get_weather", "arguments": '{"city": "Rome"}'}])
    schema = tool_choice_schema(ToolChoice("required"), TOOLS)
    assert schema["type"] == "array" and len(schema["items"]["anyOf"]) == 2
    assert tool_choice_schema(named, TOOLS) == WEATHER
    assert tool_choice_schema(AUTO, TOOLS) is None


@pytest.mark.parametrize("choice, text", [
    (ToolChoice("required"), '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Pa'),
    (AUTO, 'x<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", '
           '"arguments": {"city": "Pa'),
    (ToolChoice("named", "get_weather"), '{"city": "Pa'),
])
def test_cut_short_every_mode_returns_the_begun_call_with_its_arguments_so_far(choice, text):
    """One behaviour at `length` (vLLM's for a named function): the call as far as it got."""
    whole = [{"name": "get_time", "arguments": "{}"}] if choice.mode != "named" else []
    for size in (1, 4, len(text)):
        content, calls = _feed(choice, [text[i:i + size] for i in range(0, len(text), size)])
        assert calls == whole + [{"name": "get_weather", "arguments": '{"city": "Pa'}], (choice, size)
        assert content == ("x" if choice.mode == "auto" else "")
    # cut inside the name: no call (required: the text stays content; auto: dropped, as vLLM's parser)
    assert _feed(AUTO, ['x<tool_call>{"name": "get_w']) == ("x", [])


def test_tool_choice_defaults_and_refusals():
    assert parse_tool_choice(None, TOOLS) == AUTO and parse_tool_choice(None, []) == ToolChoice("none")
    with pytest.raises(ValueError, match="'nope', which is not among the tools"):
        parse_tool_choice({"type": "function", "function": {"name": "nope"}}, TOOLS)
    with pytest.raises(ValueError, match="must be"):
        parse_tool_choice("sometimes", TOOLS)
    with pytest.raises(ValueError, match="unique"):
        validate_tools([{"type": "function", "function": {"name": "f"}}] * 2)


def test_chat_request_with_tools_and_constraints():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    request = parse_chat_request(body).to_generate_request("r")
    assert request.tools == TOOLS and request.tool_choice == ToolChoice("named", "get_weather")
    assert request.sampling.structured_outputs.json == WEATHER
    with pytest.raises(RequestError) as exc:
        parse_chat_request({**body, "response_format": {"type": "json_object"}}).to_generate_request("r")
    assert exc.value.param == "response_format"
    fmt = {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}}
    request = parse_chat_request({**body, "tool_choice": "none", **fmt}).to_generate_request("r")
    assert request.sampling.structured_outputs.json == WEATHER and request.tool_choice == ToolChoice("none")
    request = parse_chat_request({**body, "tool_choice": None, "logit_bias": {"7": -3}, "bad_words": ["x"],
                                  "allowed_token_ids": [1, 2]}).to_generate_request("r")
    assert (request.sampling.logit_bias, request.sampling.bad_words, request.sampling.allowed_token_ids) == (
        {7: -3.0}, ["x"], [1, 2])


def test_follow_up_messages_keep_tool_calls_and_ids():
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]
    request = parse_chat_request({"model": "m", "messages": messages, "tools": TOOLS}).to_generate_request("r")
    assert request.messages[1]["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": {}}}]
    assert request.messages[2] == {"role": "tool", "content": "noon", "tool_call_id": "call_1"}


def test_chat_format_streams_what_it_answers_whole():
    fmt = ChatFormat("id", "m", 0, str, False, tool_choice=AUTO)
    pieces = [HERMES[i:i + 4] for i in range(0, len(HERMES), 4)]
    chunks = [fmt.delta_chunk(0, Delta(p, [1], "stop" if i == len(pieces) - 1 else None, 3))
              for i, p in enumerate(pieces)]
    deltas = [c["choices"][0] for c in chunks if c is not None]
    assert deltas[-1]["finish_reason"] == "tool_calls"
    streamed = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
    output = SequenceOutput(0)
    output.add(Delta(HERMES, [1], "stop", 3))
    [choice] = ChatFormat("id", "m", 0, str, False, tool_choice=AUTO).response([output])["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in streamed]
    assert "".join(d["delta"].get("content", "") for d in deltas) == "Sure."
