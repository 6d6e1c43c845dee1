"""`qwen3_coder` (vLLM's name; Qwen3.5, Qwen3.6, Qwen3-Coder): XML functions in `<tool_call>` blocks.

    some text
    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Read as vLLM's qwen3_coder parser reads it. Each `<function=NAME>` of a block
is a call (a block may hold several; `</function>` may be left out); text
outside the tags is dropped. A value is the text after `<parameter=KEY>` up to
`</parameter>` (or the next `<parameter=`, or the function's end), less one
line break at each end (the template's); other white space is the value's.
Values are typed by the parameter's schema in the request's tools: a parameter
of no schema (no such tool, or absent from its properties) or typed "string"
keeps its text; else the first of null ("null"), integer, number (a whole
number as an integer), boolean ("true"/"1", "false"/"0"), object or array
(JSON) that the schema allows and the text reads as, else JSON, else the
text. A closed block of no call before any call is content as written (vLLM
answers such text as content). Cut short (an unclosed last block), its whole
functions are calls, and the last one begun, when its name is whole, is given
with the arguments so far: the pairs read, then the value begun, as JSON text
left open (`{"city": "Pa`) when the value would be a string, else as written;
nothing closes the object.
"""
from __future__ import annotations

import json
import re
from typing import Any

from epd.api.tool_parsers.base import TaggedBlockParser, partial_suffix

PARAMETER_END = "</parameter>"
# the markers a value cut short may end in the beginning of (held back from the value)
_VALUE_ENDS = (PARAMETER_END, "<parameter=", "</function>", "</tool_call>")
# a function: its name, then its body up to </function>, the next function or the block's end
_FUNCTION = re.compile(r"<function=([^<>\n]*)>(.*?)(?:</function>|(?=<function=)|\Z)", re.DOTALL)
_WHOLE_FUNCTION = re.compile(r"<function=([^<>\n]*)>(.*?)(?:</function>|(?=<function=))", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^<>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)
_WHOLE_PARAMETER = re.compile(r"<parameter=([^<>\n]*)>(.*?)(?:</parameter>|(?=<parameter=))", re.DOTALL)
_BEGUN_FUNCTION = re.compile(r"<function=([^<>\n]*)>(.*)", re.DOTALL)
_BEGUN_PARAMETER = re.compile(r"<parameter=([^<>\n]*)>")
_TYPE_PRIORITY = ("null", "integer", "number", "boolean", "object", "array", "string")
# the schema type names vLLM also reads, by the JSON schema name they stand for
_TYPE_ALIASES = {"str": "string", "text": "string", "varchar": "string", "char": "string", "enum": "string",
                 "int": "integer", "int32": "integer", "int64": "integer", "uint": "integer",
                 "uint32": "integer", "uint64": "integer", "long": "integer", "short": "integer",
                 "unsigned": "integer", "float": "number", "float32": "number", "float64": "number",
                 "double": "number", "bool": "boolean", "dict": "object", "arr": "array", "list": "array",
                 "sequence": "array"}


class Qwen3CoderParser(TaggedBlockParser):
    name = "qwen3_coder"
    unread_block_is_content = True

    def closed_calls(self, block: str) -> list[tuple[str, str]]:
        return [self._call(name, body) for name, body in _FUNCTION.findall(block) if name.strip()]

    def cut_calls(self, block: str) -> list[tuple[str, str]]:
        """An unclosed block: its whole functions, then the last one begun with its arguments so far."""
        calls, end = [], 0
        for match in _WHOLE_FUNCTION.finditer(block):
            if match.group(1).strip():
                calls.append(self._call(match.group(1), match.group(2)))
            end = match.end()
        begun = _BEGUN_FUNCTION.search(block, end)
        if begun is not None and begun.group(1).strip():
            calls.append(self._begun_call(begun.group(1).strip(), begun.group(2)))
        return calls

    def _call(self, name: str, body: str) -> tuple[str, str]:
        name = name.strip()
        return name, "{" + ", ".join(self._pairs(name, body, _PARAMETER)) + "}"

    def _pairs(self, name: str, body: str, parameter: re.Pattern) -> list[str]:
        """`"key": value` JSON of each parameter `parameter` finds in `body` (a key given twice: its last value)."""
        values = {}
        for key, text in parameter.findall(body):
            values[key.strip()] = self._value(name, key.strip(), _trim_line_breaks(text))
        return [f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
                for key, value in values.items()]

    def _value(self, name: str, key: str, text: str) -> Any:
        schema = self.parameter_schema(name, key)
        return text if schema is None else _typed(text, _schema_types(schema))

    def _begun_call(self, name: str, body: str) -> tuple[str, str]:
        """A function cut short: the whole pairs, then the value begun (the last `<parameter=KEY>` unclosed)."""
        pairs = self._pairs(name, body, _WHOLE_PARAMETER)
        begun_parameters = list(_BEGUN_PARAMETER.finditer(body))
        begun = begun_parameters[-1] if begun_parameters else None
        if begun is not None and PARAMETER_END not in body[begun.end():]:
            key, value = begun.group(1).strip(), body[begun.end():]
            value = _trim_line_breaks(value[:len(value) - max(partial_suffix(value, e) for e in _VALUE_ENDS)])
            schema = self.parameter_schema(name, key)
            if schema is None or "string" in _schema_types(schema):
                value = '"' + json.dumps(value, ensure_ascii=False)[1:-1]
            else:
                value = value.strip()
            pairs.append(f"{json.dumps(key, ensure_ascii=False)}: {value}")
        return name, "{" + ", ".join(pairs) if pairs else ""


def _trim_line_breaks(text: str) -> str:
    """`text` less one line break at its start and one at its end (the template's markup)."""
    text = text[1:] if text.startswith("\n") else text
    return text[:-1] if text.endswith("\n") else text


def _schema_types(schema: Any) -> set[str]:
    """The JSON types a parameter's schema allows: its "type" (one or a list), its enum's
    values' types, and those of anyOf / oneOf / allOf; {"string"} when it names none."""
    if not isinstance(schema, dict):
        return {"string"}
    types: set[str] = set()
    declared = schema.get("type")
    declared = [declared] if isinstance(declared, str) else declared if isinstance(declared, list) else []
    for name in (n.strip().lower() for n in declared if isinstance(n, str)):
        types.add(_TYPE_ALIASES.get(name, name))
    if isinstance(schema.get("enum"), list):
        types |= {_json_type(value) for value in schema["enum"]}
    for choice in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(choice), list):
            for option in schema[choice]:
                types |= _schema_types(option)
    return types or {"string"}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    for kind, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                       (list, "array"), (dict, "object")):
        if isinstance(value, kind):
            return name
    return "string"


def _typed(text: str, types: set[str]) -> Any:
    """`text` as the first type of `types` it reads as (see the module), else JSON, else itself."""
    for kind in _TYPE_PRIORITY:
        if kind not in types:
            continue
        if kind == "string":
            return text
        if kind == "null" and text.lower() == "null":
            return None
        if kind == "integer":
            try:
                return int(text)
            except ValueError:
                continue
        if kind == "number":
            try:
                number = float(text)
            except ValueError:
                continue
            if _is_json(number):
                return int(number) if number == int(number) else number
        if kind == "boolean" and text.strip().lower() in ("true", "1", "false", "0"):
            return text.strip().lower() in ("true", "1")
        if kind in ("object", "array"):
            value = _json(text)
            if value is not _NOT_JSON:
                return value
    value = _json(text)
    return text if value is _NOT_JSON else value


_NOT_JSON = object()


def _json(text: str) -> Any:
    """`text` read as JSON that can be written back (no NaN or infinity), else _NOT_JSON."""
    try:
        value = json.loads(text)
    except ValueError:
        return _NOT_JSON
    return value if _is_json(value) else _NOT_JSON


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        return False
    return True
