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

from epd.api.tool_parsers.base import TaggedBlockParser, arguments_json, begun_json_call


class HermesParser(TaggedBlockParser):
    name = "hermes"

    def closed_calls(self, block: str) -> list[tuple[str, str]]:
        return _block_call(block)

    def cut_calls(self, block: str) -> list[tuple[str, str]]:
        begun = _block_call(block) or [begun_json_call(block, 0, "arguments")]
        return [call for call in begun if call is not None]


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
