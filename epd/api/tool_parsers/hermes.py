"""`hermes` (vLLM's name; Qwen's format): JSON objects in `<tool_call>` blocks.

    some text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A block that is not such an object is dropped (as vLLM's hermes parser does);
an unclosed last block is a call cut short: its name and the arguments text
after `"arguments": `.
"""
from __future__ import annotations

import json

from epd.api.tool_parsers.base import Found, ToolParser, arguments_json, begun_json_call, partial_suffix

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self.buffer = ""  # text not yet turned into content or calls
        self.in_calls = False  # a <tool_call> was seen: later text is calls only

    def feed(self, text: str) -> Found:
        self.buffer += text
        return self._parse(final=False)

    def finish(self) -> Found:
        return self._parse(final=True)

    def _parse(self, final: bool) -> Found:
        out = Found()
        while True:
            if not self.in_calls:
                start = self.buffer.find(TOOL_CALL_START)
                if start < 0:
                    keep = 0 if final else partial_suffix(self.buffer, TOOL_CALL_START)
                    out.content += self.buffer[:len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return out
                out.content += self.buffer[:start]
                self.buffer = self.buffer[start:]
                self.in_calls = True
            start = self.buffer.find(TOOL_CALL_START)
            if start < 0:  # text between or after calls: dropped
                self.buffer = "" if final else self.buffer[len(self.buffer) - partial_suffix(self.buffer, TOOL_CALL_START):]
                return out
            end = self.buffer.find(TOOL_CALL_END, start)
            if end < 0:
                if final:  # an unclosed last block (cut by max_tokens or EOS): the call as far as it got
                    block, self.buffer = self.buffer[start + len(TOOL_CALL_START):], ""
                    begun = _block_call(block) or [begun_json_call(block, 0, "arguments")]
                    out.calls += [call for call in begun if call is not None]
                return out
            block = self.buffer[start + len(TOOL_CALL_START):end]
            self.buffer = self.buffer[end + len(TOOL_CALL_END):]
            out.calls += _block_call(block)


def _block_call(block: str) -> list[tuple[str, str]]:
    """The call of a closed block, or none when it is not a call object."""
    try:
        obj = json.loads(block)
        name, arguments = obj["name"], obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(name, str):
            raise TypeError
    except (ValueError, TypeError, KeyError, AttributeError):
        return []
    return [(name, arguments_json(arguments))]
