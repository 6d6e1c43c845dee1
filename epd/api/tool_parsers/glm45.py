"""`glm45` (vLLM's name; GLM-4.5, GLM-4.5V and GLM-4.1V): a name and key/value tags in `<tool_call>` blocks.

    some text<tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

The name is the block's text up to its first line break or `<arg_key>`. A
value is read as vLLM's glm45 parser reads it: as written when the tool's
schema types that parameter "string"; else as JSON, else as a Python literal
(`True`, `None`, `'x'`), else as the string it is. The arguments are the JSON
object of the pairs in order. A block without a name is dropped. Cut short
(an unclosed last block whose name is whole), the call's arguments are the
JSON of the pairs so far, then the value begun: a string value as JSON text
left open (`{"city": "Pa`), another as written; nothing closes the object.
"""
from __future__ import annotations

import ast
import json
import re
from typing import Any

from epd.api.tool_parsers.base import TaggedBlockParser, partial_suffix

ARG_KEY, ARG_VALUE, ARG_VALUE_END = "<arg_key>", "<arg_value>", "</arg_value>"
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_BEGUN_VALUE = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>", re.DOTALL)


class Glm45Parser(TaggedBlockParser):
    name = "glm45"

    def closed_calls(self, block: str) -> list[tuple[str, str]]:
        name, body = _name(block, closed=True)
        return [(name, "{" + ", ".join(self._pairs(name, body)) + "}")] if name else []

    def _pairs(self, name: str, body: str) -> list[str]:
        """`"key": value` JSON of each whole key/value pair."""
        pairs = []
        for key, value in _PAIR.findall(body):
            key = key.strip()
            pairs.append(f"{json.dumps(key, ensure_ascii=False)}: "
                         f"{json.dumps(self._value(name, key, value), ensure_ascii=False)}")
        return pairs

    def _value(self, name: str, key: str, text: str) -> Any:
        if self.parameter_type(name, key) == "string":
            return text
        try:
            return json.loads(text.strip())
        except ValueError:
            pass
        try:
            value = ast.literal_eval(text.strip())
            json.dumps(value)  # a set or bytes is not JSON: the text itself then
            return value
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return text.strip()

    def cut_calls(self, block: str) -> list[tuple[str, str]]:
        """An unclosed block: its call with the arguments so far, none when the name was cut."""
        name, body = _name(block, closed=False)
        if not name:
            return []
        pairs = self._pairs(name, body)
        value_at = body.rfind(ARG_VALUE)
        if value_at >= 0 and body.find(ARG_VALUE_END, value_at) < 0:  # a value begun
            key = None
            for match in _BEGUN_VALUE.finditer(body, 0, value_at + len(ARG_VALUE)):
                key = match.group(1).strip()
            if key is not None:
                value = body[value_at + len(ARG_VALUE):]
                value = value[:len(value) - partial_suffix(value, ARG_VALUE_END)]
                if self.parameter_type(name, key) == "string":
                    value = '"' + json.dumps(value, ensure_ascii=False)[1:-1]
                pairs.append(f"{json.dumps(key, ensure_ascii=False)}: {value}")
        return [(name, "{" + ", ".join(pairs) if pairs else "")]


def _name(block: str, closed: bool) -> tuple[str, str]:
    """(the block's name, the rest); the name is "" until a line break or <arg_key> ends it
    (or the block's end, when it is closed)."""
    ends = [i for i in (block.find("\n"), block.find(ARG_KEY)) if i >= 0]
    if not ends and not closed:
        return "", ""
    cut = min(ends) if ends else len(block)
    return block[:cut].strip(), block[cut:]
