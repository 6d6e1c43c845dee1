"""Each --tool-call-parser format (epd/api/tool_parsers/): the calls and content of a
whole text, the same when the text comes split at every character, and the rules
every format keeps (content before the first call, later text dropped, a call cut
short given as far as its arguments got, one cut before its name dropped)."""
from __future__ import annotations

import json

import pytest

from epd.api.completions_format import ChatFormat, SequenceOutput
from epd.api.protocol import Delta
from epd.api.tool_calls import ToolCallParser, ToolChoice, validate_tools
from epd.api.tool_parsers import TOOL_PARSERS, tool_parser
from epd.config import TOOL_CALL_PARSERS
from epd.families.registry import FAMILIES

TOOLS = validate_tools([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "get_time"}}])


def _parse(name: str, text: str, tools=TOOLS) -> tuple[str, list[tuple[str, str]]]:
    """Content and calls of `text` fed whole, asserted equal to it fed one character at a time."""
    results = []
    for pieces in ([text], list(text)):
        parser = tool_parser(name, tools)
        content, calls = "", []
        for found in [parser.feed(p) for p in pieces] + [parser.finish()]:
            content += found.content
            calls += found.calls
        results.append((content, calls))
    assert results[0] == results[1], (name, text)
    return results[0]


def test_the_config_names_every_parser_and_the_families_name_known_ones():
    assert TOOL_CALL_PARSERS == tuple(TOOL_PARSERS)
    assert {f.tool_call_parser for f in FAMILIES.values()} - {None} <= set(TOOL_PARSERS)
    assert FAMILIES["qwen3_vl"].tool_call_parser == "hermes"
    assert FAMILIES["internvl"].tool_call_parser == "hermes"  # a Qwen3 (or Qwen2) language model
    assert FAMILIES["qwen3_5"].tool_call_parser == FAMILIES["qwen3_5_moe"].tool_call_parser == "qwen3_coder"


PYTHONIC = [
    ('[get_weather(city="Paris", days=3), get_time(zone=\'UTC\')]',
     "", [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", '{"zone": "UTC"}')]),
    # literals: negative numbers, tuples as lists, dicts, None/True; white space before the list
    ('\n [f(a=[1, -2.5, (3, 4)], b={"k": None, "t": True}, s="x]y)z\\"w")]',
     "", [("f", '{"a": [1, -2.5, [3, 4]], "b": {"k": null, "t": true}, "s": "x]y)z\\"w"}')]),
    ('[get_time()]\nI asked for the time.', "", [("get_time", "{}")]),  # after the list: dropped
    ("[f(a=true, b=null, c=[false])]", "", [("f", '{"a": true, "b": null, "c": [false]}')]),  # JSON's names
    ("[f(x=1), g(1), h(y=2)]", "", [("f", '{"x": 1}')]),  # an item that is not a call ends the calls
    ('[get_time(), get_weather(city="Pa', "", [("get_time", "{}"), ("get_weather", '{"city": "Pa')]),  # cut
    ('[get_weather(city="Paris", da', "", [("get_weather", '{"city": "Paris"')]),  # cut in a keyword
    ("[get_weather(days=[1, 2", "", [("get_weather", '{"days": [1, 2')]),
    ("[get_time(), get_wea", "", [("get_time", "{}")]),  # cut in a name: that call dropped
]
PYTHONIC_CONTENT = ["The answer is 4.", "[1, 2] are numbers", "[]", "see [f(x=1)]", "[get_wea", "[f(x=os.environ)]",
                    "[f(**kw)]", "[f(x={1, 2})]", "  ", "[f(x=1)) broken"]


@pytest.mark.parametrize("text, content, calls", PYTHONIC)
def test_pythonic_calls(text, content, calls):
    assert _parse("pythonic", text) == (content, calls)


@pytest.mark.parametrize("text", PYTHONIC_CONTENT)
def test_pythonic_text_that_is_not_a_list_of_calls_is_content(text):
    assert _parse("pythonic", text) == (text, [])


GLM = ("Let me check.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>123</arg_value>\n"
       "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>then<tool_call>get_time\n</tool_call>")


def test_glm45_reads_values_by_the_parameters_schema_type():
    calls = [("get_weather", '{"city": "123", "days": 3}'), ("get_time", "{}")]
    assert _parse("glm45", GLM) == ("Let me check.", calls)
    # without tools, a value is JSON when it parses as JSON (vLLM's rule)
    assert _parse("glm45", GLM, tools=[]) == ("Let me check.", [("get_weather", '{"city": 123, "days": 3}'),
                                                                 ("get_time", "{}")])


@pytest.mark.parametrize("value, read", [
    ('{"a": [1, 2]}', {"a": [1, 2]}), ("True", True), ("None", None), ("'x'", "x"), (" 2.5 ", 2.5),
    ("Paris", "Paris"), ("{1, 2}", "{1, 2}"), ("null", None)])
def test_glm45_value_json_else_python_literal_else_text(value, read):
    text = f"<tool_call>f\n<arg_key>v</arg_key>\n<arg_value>{value}</arg_value>\n</tool_call>"
    [(name, arguments)] = _parse("glm45", text)[1]
    assert name == "f" and json.loads(arguments) == {"v": read}


def test_glm45_string_values_keep_their_text_and_escape_as_json():
    text = '<tool_call>get_weather<arg_key>city</arg_key><arg_value> "New"\nYork </arg_value></tool_call>'
    assert _parse("glm45", text) == ("", [("get_weather", json.dumps({"city": ' "New"\nYork '}))])


@pytest.mark.parametrize("text, calls", [
    ("x<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Pa</arg_v", [("get_weather", '{"city": "Pa')]),
    ('x<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>a"b', [("get_weather", '{"city": "a\\"b')]),
    ("x<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n<arg_key>days</arg_key>\n"
     "<arg_value>3", [("get_weather", '{"city": "Oslo", "days": 3')]),
    ("x<tool_call>get_weather\n<arg_key>ci", [("get_weather", "")]),
    ("x<tool_call>get_time\n</tool_call><tool_call>get_wea", [("get_time", "{}")]),
    ("x<tool_call></tool_call>", []),  # no name: dropped
])
def test_glm45_cut_short_gives_the_arguments_so_far(text, calls):
    assert _parse("glm45", text) == ("x", calls)


@pytest.mark.parametrize("text", ["no calls here", "a <tool_call", "ends with <tool_"])
def test_glm45_text_without_a_call_is_content(text):
    assert _parse("glm45", text) == (text, [])


QWEN3 = ("Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n123\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\nthen\n<tool_call>\n<function=get_time>\n"
         "</function>\n</tool_call>")
TYPED = validate_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"}, "b": {"type": "boolean"},
    "o": {"type": "object"}, "a": {"type": "array"}, "z": {"type": ["integer", "null"]},
    "e": {"enum": [1, 2]}, "u": {"anyOf": [{"type": "boolean"}, {"type": "string"}]}, "x": {}}}}}])


def _qwen3_call(parameters: str) -> str:
    return f"<tool_call>\n<function=f>\n{parameters}</function>\n</tool_call>"


def test_qwen3_coder_two_calls_after_text_typed_by_the_schema():
    """vLLM's qwen3_coder: a string parameter keeps its text ("123"), an integer is read;
    text between calls is dropped; without tools every value is its text."""
    calls = [("get_weather", '{"city": "123", "days": 3}'), ("get_time", "{}")]
    assert _parse("qwen3_coder", QWEN3) == ("Let me check.\n", calls)
    assert _parse("qwen3_coder", QWEN3, tools=[]) == ("Let me check.\n", [("get_weather", '{"city": "123", "days": "3"}'),
                                                                          ("get_time", "{}")])


@pytest.mark.parametrize("key, value, read", [
    ("s", " 12 \n", " 12 \n"), ("s", "null", "null"), ("i", "7", 7), ("i", "seven", "seven"), ("n", "2.0", 2),
    ("n", "-0.5", -0.5), ("n", "1e999", "1e999"), ("b", "True", True), ("b", "0", False), ("b", "yes", "yes"),
    ("o", '{"k": [1, null]}', {"k": [1, None]}), ("a", "[1, 2]", [1, 2]), ("a", "[1,", "[1,"),
    ("z", "null", None), ("z", "4", 4), ("e", "2", 2), ("u", "false", False), ("u", "maybe", "maybe"),
    ("x", "5", "5"),  # a schema of no type: a string
    ("absent", "5", "5"),  # a parameter absent from the schema: its text
])
def test_qwen3_coder_values_by_the_parameters_schema(key, value, read):
    [(name, arguments)] = _parse("qwen3_coder", _qwen3_call(f"<parameter={key}>\n{value}\n</parameter>\n"), TYPED)[1]
    assert name == "f" and json.loads(arguments) == {key: read}


def test_qwen3_coder_a_block_of_several_functions_and_parameters_left_open():
    """Several functions in one block; `</function>` left out; a parameter ended by the next one
    or by its function's end; one line break trimmed at each end of a value, no more."""
    text = ("<tool_call>\n<function=f>\n<parameter=s>\n\n two\n\n<parameter=i>\n1\n</function>\n"
            "<function=get_time>\n<parameter=zone>UTC</parameter>\n</tool_call>")
    assert _parse("qwen3_coder", text, TYPED + TOOLS) == ("", [("f", '{"s": "\\n two\\n", "i": 1}'),
                                                                ("get_time", '{"zone": "UTC"}')])


@pytest.mark.parametrize("text, content", [
    ("x<tool_call>\nnot a call\n</tool_call> y", "x<tool_call>\nnot a call\n</tool_call> y"),  # kept as text
    ("<tool_call><function=>\n</function></tool_call>", "<tool_call><function=>\n</function></tool_call>"),
    ("no calls here", "no calls here"), ("ends with <tool_", "ends with <tool_"),
])
def test_qwen3_coder_text_of_no_call_is_content(text, content):
    assert _parse("qwen3_coder", text) == (content, [])


def test_qwen3_coder_a_malformed_block_after_a_call_is_dropped():
    text = "a<tool_call>\n<function=get_time>\n</function>\n</tool_call>\n<tool_call>\noops\n</tool_call>b"
    assert _parse("qwen3_coder", text) == ("a", [("get_time", "{}")])


@pytest.mark.parametrize("text, calls", [
    ("x<tool_call>\n<function=get_weather>\n<parameter=city>\nPa</param", [("get_weather", '{"city": "Pa')]),
    ('x<tool_call>\n<function=get_weather>\n<parameter=city>\na"b\n', [("get_weather", '{"city": "a\\"b')]),
    ("x<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n3",
     [("get_weather", '{"city": "Oslo", "days": 3')]),
    ("x<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n<para", [("get_weather", '{"city": "Oslo')]),
    ("x<tool_call>\n<function=get_weather>\n<parameter=ci", [("get_weather", "")]),
    ("x<tool_call>\n<function=get_time>\n</function>\n<function=get_wea", [("get_time", "{}")]),  # name cut: dropped
    ("x<tool_call>\n<function=get_time>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n",
     [("get_time", "{}"), ("get_weather", "")]),
])
def test_qwen3_coder_cut_short_gives_the_arguments_so_far(text, calls):
    assert _parse("qwen3_coder", text) == ("x", calls)


HERMES = ('Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


@pytest.mark.parametrize("name, text", [("hermes", HERMES), ("glm45", GLM), ("pythonic", PYTHONIC[0][0]),
                                        ("qwen3_coder", QWEN3)])
def test_chat_format_streams_what_it_answers_whole_in_every_format(name, text):
    """Through ChatFormat as the route builds it: the streamed deltas (one character a token)
    give the whole answer's content and calls, and finish_reason tool_calls."""
    fmt = ChatFormat("id", "m", 0, str, False, tool_choice=ToolChoice("auto"), tools=TOOLS, tool_parser=name)
    chunks = [fmt.delta_chunk(0, Delta(ch, [1], "stop" if i == len(text) - 1 else None, 3))
              for i, ch in enumerate(text)]
    deltas = [c["choices"][0] for c in chunks if c is not None]
    streamed: dict[int, list[str]] = {}
    for call in (c for d in deltas for c in d["delta"].get("tool_calls", [])):
        entry = streamed.setdefault(call["index"], ["", ""])
        entry[0] += call["function"].get("name") or ""
        entry[1] += call["function"]["arguments"]
    output = SequenceOutput(0)
    output.add(Delta(text, [1], "stop", 3))
    whole = ChatFormat("id", "m", 0, str, False, tool_choice=ToolChoice("auto"), tools=TOOLS, tool_parser=name)
    [choice] = whole.response([output])["choices"]
    assert choice["finish_reason"] == deltas[-1]["finish_reason"] == "tool_calls"
    assert [[c["function"]["name"], c["function"]["arguments"]] for c in choice["message"]["tool_calls"]] == \
        [streamed[i] for i in sorted(streamed)]
    assert len(streamed) == 2
    assert (choice["message"]["content"] or "") == "".join(d["delta"].get("content", "") for d in deltas)


def test_required_and_named_are_the_same_json_whatever_the_format():
    required = json.dumps([{"name": "get_weather", "parameters": {"city": "Oslo"}}])
    for name in TOOL_PARSERS:
        parser = ToolCallParser(ToolChoice("required"), TOOLS, name)
        parser.feed(required)
        parser.finish()
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in parser.calls] == [
            ("get_weather", '{"city": "Oslo"}')]
