"""`ToolParser`: what every `--tool-call-parser` format gives `tool_choice` "auto".

A parser turns one choice's text into content and calls, incrementally:
`feed(text)` for each piece, `finish()` at the end. Whatever the pieces, their
results concatenate to the result of the whole text fed at once: the streamed
answer is exactly the non-streamed one. Every format keeps the same rules:

* the text before the first call is content; once a call began, later text is
  calls only (text between or after calls is dropped, as vLLM's parsers do);
* a call is given whole, once it is closed (its arguments as JSON text);
* cut short (the text ends inside a call), a call whose name was generated is
  given with the arguments generated so far, as JSON text that stops where the
  model stopped; a call cut before its name is dropped.
"""
from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Found:
    """What a piece of text adds: content, and calls as (name, arguments JSON text)."""

    content: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)

    def __iadd__(self, other: "Found") -> "Found":
        self.content += other.content
        self.calls += other.calls
        return self


class ToolParser(ABC):
    """One choice's auto-mode text -> content and calls. `tools`: the request's
    validated tools (epd/api/tool_calls.py `validate_tools`), for formats whose
    argument values are read by the parameter's schema type."""

    name: str  # vLLM's --tool-call-parser name

    def __init__(self, tools: list[dict] | None = None):
        self.tools = tools or []

    @abstractmethod
    def feed(self, text: str) -> Found:
        """The content and the calls that `text`, appended to what came before, completes."""

    @abstractmethod
    def finish(self) -> Found:
        """The end of the text: what was held back, and a call cut short (see the module)."""

    def parameter_type(self, function: str, parameter: str) -> Any:
        """The JSON schema "type" of a function's parameter, None when the tools do not say."""
        schema = self.parameter_schema(function, parameter)
        return schema.get("type") if schema is not None else None

    def parameter_schema(self, function: str, parameter: str) -> dict | None:
        """The JSON schema of a function's parameter, None when the tools do not say."""
        for tool in self.tools:
            if tool["function"]["name"] == function:
                schema = tool["function"]["parameters"].get("properties", {}).get(parameter)
                return schema if isinstance(schema, dict) else None
        return None


def arguments_json(arguments: Any) -> str:
    """A call's arguments as OpenAI's JSON text (a string is already that text)."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (held back: it may grow into it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def begun_json_call(text: str, pos: int, arguments_key: str) -> tuple[str, str] | None:
    """A JSON call object cut short at `pos`: `{"name": "...", "<arguments_key>": ` and what followed
    it, as the call's (incomplete) arguments; None when the name itself was cut."""
    head = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"' + arguments_key + r'"\s*:\s*')
    match = head.match(text, pos)
    if match is None:
        return None
    return json.loads(match.group(1)), text[match.end():].rstrip()


class TaggedBlockParser(ToolParser):
    """Calls written in `start` ... `end` blocks (hermes', GLM-4.5's `<tool_call>`): the text
    before the first block is content, text between or after blocks is dropped, a closed
    block becomes `closed_calls(block)`, an unclosed last one `cut_calls(block)`. With
    `unread_block_is_content`, a closed block of no call before any call is content, as written."""

    start = "<tool_call>"
    end = "</tool_call>"
    unread_block_is_content = False  # else a closed block of no call is dropped

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self.buffer = ""  # text not yet turned into content or calls
        self.in_calls = False  # a block was seen: later text is calls only
        self.calls_given = False  # a closed block gave a call

    def feed(self, text: str) -> Found:
        self.buffer += text
        return self._parse(final=False)

    def finish(self) -> Found:
        return self._parse(final=True)

    @abstractmethod
    def closed_calls(self, block: str) -> list[tuple[str, str]]:
        """The calls of a closed block's text (none when it is not a call)."""

    @abstractmethod
    def cut_calls(self, block: str) -> list[tuple[str, str]]:
        """An unclosed last block (cut by max_tokens or EOS): its call as far as it got, or none."""

    def _parse(self, final: bool) -> Found:
        out = Found()
        while True:
            start = self.buffer.find(self.start)
            if start < 0:
                keep = 0 if final else partial_suffix(self.buffer, self.start)
                if not self.in_calls:
                    out.content += self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]  # in calls: text between blocks is dropped
                return out
            if not self.in_calls:
                out.content += self.buffer[:start]
                self.in_calls = True
            end = self.buffer.find(self.end, start)
            if end < 0:
                self.buffer = self.buffer[start:]
                if final:
                    block, self.buffer = self.buffer[len(self.start):], ""
                    out.calls += self.cut_calls(block)
                return out
            block = self.buffer[start + len(self.start):end]
            self.buffer = self.buffer[end + len(self.end):]
            calls = self.closed_calls(block)
            if not calls and self.unread_block_is_content and not self.calls_given:
                out.content += self.start + block + self.end  # not a call: the text goes on as content
                self.in_calls = False
            self.calls_given = self.calls_given or bool(calls)
            out.calls += calls

