"""Tool calls: `tools` / `tool_choice` checked and turned into a constraint, and the
model's text turned into OpenAI `tool_calls`, streamed or whole.

`tool_choice`:
  none       the text is content, never parsed;
  auto       the text is read in the server's `--tool-call-parser` format
             (epd/api/tool_parsers/: hermes, pythonic, glm45, qwen3_coder; hermes when the flag
             is not given): the text before the first call is content;
  required   the output is constrained to a JSON array of {"name", "parameters"}
             (one of the tools each, vLLM's form) and every item is a call;
  a name     the output is constrained to that function's parameters schema and
             is the call's arguments.
`required` and a named function are the same JSON whatever the format.

Cut short (`finish_reason` "length", or an unclosed call at the end), every
mode answers alike: a call whose name was generated is returned with the
arguments text generated so far (not valid JSON then), and `finish_reason`
stays "length" — what vLLM does for a named function; a call cut before its
name is dropped (auto) or the text is content (required). See
docs/decisions/tool-calls.md.

A `ToolCallParser` per choice turns text deltas into content deltas and call
deltas; the whole answer is the same parser fed the whole text at once, so
streamed deltas concatenate to exactly the non-streamed message.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from epd.api.tool_parsers import Found, ToolParser, tool_parser
from epd.api.tool_parsers.base import arguments_json, begun_json_call
from epd.requests import ToolChoice  # noqa: F401 (re-exported)

DEFAULT_TOOL_PARSER = "hermes"  # auto's format when --tool-call-parser is not given


class ToolError(ValueError):
    """A bad `tools` / `tool_choice`; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def validate_tools(tools: list[Any]) -> list[dict]:
    """OpenAI function tools -> [{"type": "function", "function": {name, description?, parameters}}]."""
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ToolError(f"{where}.type: only function tools are supported", f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolError(f"{where}.function.name: must be a non-empty string", f"{where}.function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError(f"{where}.function.parameters: must be a JSON schema object",
                            f"{where}.function.parameters")
        clean = {"name": fn["name"], "parameters": params}
        if isinstance(fn.get("description"), str):
            clean["description"] = fn["description"]
        out.append({"type": "function", "function": clean})
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        raise ToolError("tools: function names must be unique", "tools")
    return out


def parse_tool_choice(tool_choice: Any, tools: list[dict]) -> ToolChoice:
    """OpenAI's tool_choice (default: "auto" with tools, "none" without)."""
    names = [t["function"]["name"] for t in tools]
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not tools:
            raise ToolError(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        return ToolChoice(tool_choice)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise ToolError(f"tool_choice names the function {name!r}, which is not among the tools "
                            f"({', '.join(names) or 'none given'})", "tool_choice")
        return ToolChoice("named", name)
    raise ToolError("tool_choice must be 'none', 'auto', 'required' or "
                    "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")


def tool_choice_schema(choice: ToolChoice, tools: list[dict]) -> dict | None:
    """The JSON schema the output must follow, for `required` and a named function."""
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    if choice.mode == "named":
        return by_name[choice.name]
    if choice.mode == "required":
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                  "required": ["name", "parameters"]} for name, params in by_name.items()]
        return {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    return None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: Any) -> dict:
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments_json(arguments)}}


@dataclass
class ParsedDelta:
    """What a piece of text adds: content, and tool-call deltas in OpenAI's streamed form
    ({"index", "id"?, "type"?, "function": {"name"?, "arguments"}})."""

    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)


class ToolCallParser:
    """One choice's text -> content and tool calls, incrementally (`feed`, then `finish`).
    `parser`: auto's format (a --tool-call-parser name); `tools`: the request's, for
    formats that read a value by its parameter's type."""

    def __init__(self, choice: ToolChoice, tools: list[dict] | None = None, parser: str = DEFAULT_TOOL_PARSER):
        self.choice = choice
        self.buffer = ""  # required: the JSON array, parsed at the end
        self.calls: list[dict] = []  # complete calls, OpenAI's non-streamed form
        self._named_id: str | None = None
        self._auto: ToolParser | None = tool_parser(parser, tools) if choice.mode == "auto" else None

    def feed(self, text: str) -> ParsedDelta:
        mode = self.choice.mode
        if mode == "none":
            return ParsedDelta(content=text)
        if mode == "named":
            return self._named(text)
        if mode == "required":
            self.buffer += text
            return ParsedDelta()  # one JSON array: parsed at the end
        return self._found(self._auto.feed(text))

    def finish(self) -> ParsedDelta:
        mode = self.choice.mode
        if mode == "required":
            return self._required()
        if mode == "auto":
            return self._found(self._auto.finish())
        if mode == "named" and self._named_id is None:
            return self._named("")
        return ParsedDelta()

    # -- modes ------------------------------------------------------------------------------

    def _named(self, text: str) -> ParsedDelta:
        if self._named_id is None:
            self._named_id = new_call_id()
            self.calls.append({"id": self._named_id, "type": "function",
                               "function": {"name": self.choice.name, "arguments": ""}})
            self.calls[0]["function"]["arguments"] += text
            return ParsedDelta(tool_calls=[{"index": 0, "id": self._named_id, "type": "function",
                                            "function": {"name": self.choice.name, "arguments": text}}])
        self.calls[0]["function"]["arguments"] += text
        return ParsedDelta(tool_calls=[{"index": 0, "function": {"arguments": text}}] if text else [])

    def _required(self) -> ParsedDelta:
        text, self.buffer = self.buffer, ""
        try:
            items = json.loads(text)
            calls = [_call(item["name"], item["parameters"]) for item in items]
        except (ValueError, TypeError, KeyError):
            calls = _begun_calls(text)  # cut short (length): the calls as far as they got
            if not calls:
                return ParsedDelta(content=text)  # not even a name: the text as content
        return self._add(calls)

    def _found(self, found: Found) -> ParsedDelta:
        return ParsedDelta(content=found.content, tool_calls=self._add([_call(*c) for c in found.calls]).tool_calls)

    def _add(self, calls: list[dict]) -> ParsedDelta:
        deltas = []
        for call in calls:
            deltas.append({"index": len(self.calls), **call})
            self.calls.append(call)
        return ParsedDelta(tool_calls=deltas)


_SEPARATOR = re.compile(r"\s*,?\s*")


def _begun_calls(text: str) -> list[dict]:
    """The calls of a `required` array cut short: its whole items, then the last
    one begun with the arguments text generated so far (if its name is whole)."""
    start = text.find("[")
    if start < 0:
        return []
    calls, pos, decoder = [], start + 1, json.JSONDecoder()
    while True:
        pos = _SEPARATOR.match(text, pos).end()
        try:
            item, pos = decoder.raw_decode(text, pos)
            calls.append(_call(item["name"], item["parameters"]))
        except (ValueError, TypeError, KeyError):
            begun = begun_json_call(text, pos, "parameters")
            return calls + ([_call(*begun)] if begun else [])
