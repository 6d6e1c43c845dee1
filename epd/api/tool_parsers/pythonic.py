"""`pythonic` (vLLM's name; Llama 3.2 and vLLM's Gemma 3 tool template): a Python list of calls.

    [get_weather(city="Paris", days=3), get_time(zone="UTC")]

The text is calls when it begins (after white space) with a list whose first
item is a call `name(keyword=literal, ...)`; anything else is content. Items
are read one at a time as the list's brackets and strings close, each with
`ast` (never evaluated): keyword arguments only, their values literals
(strings, numbers, True/False/None, lists, tuples as lists, dicts; JSON's
true/false/null too, which vLLM's Gemma 3 template writes). A call is
given when its item closes; an item that is not such a call ends the calls
(the rest is dropped, as is the text after the list's `]`). Cut short, the
item begun is given with its arguments so far: the call's text closed where
it stopped, read as above, and the JSON of what was closed left off —
`get_weather(city="Pa` gives `{"city": "Pa`.
"""
from __future__ import annotations

import ast
import json
import re
from typing import Any

from epd.api.tool_parsers.base import Found, ToolParser

_OPENERS = {"(": ")", "[": "]", "{": "}"}
_JSON_NAMES = {"true": True, "false": False, "null": None}  # vLLM's Gemma 3 template writes values as JSON
_NAME = re.compile(r"\s*[A-Za-z_]\w*\s*\(")


class _NotACall(ValueError):
    pass


class PythonicParser(ToolParser):
    name = "pythonic"

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self.state = "start"  # start (white space so far), list, content, done
        self.held = ""  # the text since the start while no call was found: content if none is
        self.item = ""  # the current item of the list
        self.stack: list[str] = []  # open brackets and the open string's quote, within the item
        self.escaped = False  # in a string, after a backslash
        self.arg_ends: list[int] = []  # offsets in `item` after its call's "(" and each top-level comma in it
        self.num_calls = 0

    def feed(self, text: str) -> Found:
        out = Found()
        for i, ch in enumerate(text):
            if self.state == "content":
                out.content += text[i:]
                break
            if self.state == "done":
                break
            if self.state == "start":
                self.held += ch
                if ch == "[":
                    self.state = "list"
                elif not ch.isspace():
                    self._to_content(out)
                continue
            if self.num_calls == 0:
                self.held += ch
            self._scan(ch, out)
        return out

    def finish(self) -> Found:
        out = Found()
        if self.state == "start":
            self._to_content(out)
        elif self.state == "list":
            begun = _begun_call(self.item, self.stack, self.escaped, self.arg_ends)
            if begun is not None:
                out.calls.append(begun)
            elif self.num_calls == 0:
                self._to_content(out)
            self.state = "done"
        return out

    def _to_content(self, out: Found) -> None:
        out.content += self.held
        self.held = ""
        self.state = "content"

    def _scan(self, ch: str, out: Found) -> None:
        """One character of the list: into the item, or the item's end (`,` or `]` at the list's level)."""
        stack = self.stack
        if stack and stack[-1] in "'\"":
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == stack[-1]:
                stack.pop()
            self.item += ch
            return
        if not stack and ch in ",]":
            self._end_item(ch, out)
            return
        if ch in "'\"" or ch in _OPENERS:
            stack.append(ch)
            if ch == "(" and len(stack) == 1:
                self.arg_ends = [len(self.item) + 1]
        elif ch in ")]}":
            if not stack or _OPENERS.get(stack.pop()) != ch:
                self._end_item(None, out)  # unbalanced: not a list of calls
                return
        elif ch == "," and stack == ["("]:
            self.arg_ends.append(len(self.item) + 1)
        self.item += ch

    def _end_item(self, end: str | None, out: Found) -> None:
        item, self.item, self.stack, self.arg_ends = self.item, "", [], []
        if end == "]" and not item.strip() and self.num_calls:  # a trailing comma: [f(), ]
            self.state = "done"
            return
        try:
            if end is None:  # an unbalanced bracket
                raise _NotACall(item)
            call = _call(item)
        except (_NotACall, SyntaxError, ValueError):
            if self.num_calls == 0:
                self._to_content(out)
            else:
                self.state = "done"
            return
        out.calls.append(call)
        self.num_calls += 1
        self.held = ""
        if end == "]":
            self.state = "done"


def _call(item: str) -> tuple[str, str]:
    """`name(keyword=literal, ...)` -> (name, arguments JSON text)."""
    node = ast.parse(item.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise _NotACall(item)
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **kwargs
            raise _NotACall(item)
        arguments[keyword.arg] = _literal(keyword.value)
    return node.func.id, json.dumps(arguments, ensure_ascii=False)


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) \
            and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) for k in node.keys):
        return {k.value: _literal(v) for k, v in zip(node.keys, node.values)}
    raise _NotACall(ast.dump(node))


def _begun_call(item: str, stack: list[str], escaped: bool, arg_ends: list[int]) -> tuple[str, str] | None:
    """An item cut short: (name, the JSON of its arguments so far), None when its name was cut.
    The item closed where it stopped; failing that, closed after its last whole argument."""
    if not stack or stack[0] != "(" or not _NAME.match(item):
        return None
    text = item[:-1] if escaped else item  # a backslash cut from what it escaped
    tries = [(text, stack)] + [(item[:end], ["("]) for end in reversed(arg_ends)]
    for text, open_ in tries:
        closers = "".join(_OPENERS.get(c, c) for c in reversed(open_))
        # what each closer is in the JSON: the call's ( is the object's }, a tuple's ( a list's ]
        json_end = "".join('"' if c in "'\"" else "}" if (c == "(" and i == 0) or c == "{" else "]"
                           for i, c in reversed(list(enumerate(open_))))
        try:
            name, arguments = _call(text + closers)
        except (_NotACall, SyntaxError, ValueError):
            continue
        if arguments.endswith(json_end):
            return name, arguments[:len(arguments) - len(json_end)]
    return None
