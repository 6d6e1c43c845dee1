"""A flag's JSON object (vLLM's --speculative-config, --kv-events-config, --mm-processor-kwargs...),
read in one place: from the command line's text or, through `LLM(...)`, a mapping as it is.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def json_object(flag: str, value: str | Mapping[str, Any]) -> Mapping[str, Any]:
    """`value` as a mapping: JSON text parsed, a mapping unchanged. ValueError naming `flag` when
    the text is not JSON or not an object."""
    parsed = value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag} is not valid JSON: {exc}") from None
    if not isinstance(parsed, Mapping):
        raise ValueError(f"{flag} takes a JSON object, got {value!r}")
    return parsed
