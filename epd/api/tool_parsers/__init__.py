"""Tool-call formats by vLLM's `--tool-call-parser` names: the model's text under
`tool_choice` "auto" -> content and calls (epd/api/tool_calls.py uses them).

    base.py      `ToolParser` (feed / finish -> `Found`), the rules every format keeps;
                 `TaggedBlockParser`: calls in <tool_call> blocks (hermes, glm45, qwen3_coder)
    hermes.py    `hermes`: JSON objects in <tool_call> blocks (Qwen)
    pythonic.py  `pythonic`: a Python list of calls, read with `ast` (Llama 3.2, Gemma 3)
    glm45.py     `glm45`: a name and <arg_key>/<arg_value> tags in <tool_call> blocks (GLM-4.1V, GLM-4.5V)
    qwen3_coder.py  `qwen3_coder`: <function=NAME> and <parameter=KEY> tags in <tool_call> blocks (Qwen3.5)

Torch-free. (epd/config.py names the same table for --tool-call-parser; a test holds them equal.)
"""
from __future__ import annotations

from epd.api.tool_parsers.base import Found, ToolParser
from epd.api.tool_parsers.glm45 import Glm45Parser
from epd.api.tool_parsers.hermes import HermesParser
from epd.api.tool_parsers.pythonic import PythonicParser
from epd.api.tool_parsers.qwen3_coder import Qwen3CoderParser

__all__ = ["TOOL_PARSERS", "Found", "ToolParser", "tool_parser"]

TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, PythonicParser, Glm45Parser,
                                                                Qwen3CoderParser)}


def tool_parser(name: str, tools: list[dict] | None = None) -> ToolParser:
    """A fresh parser of the format `name` (one of TOOL_PARSERS) for one choice."""
    return TOOL_PARSERS[name](tools)
