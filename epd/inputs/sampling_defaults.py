"""The sampling values a request gets for the fields it leaves out.

vLLM's `--generation-config` (default `auto`) and `--override-generation-config`:

    auto   the checkpoint's generation_config.json
    vllm   none: vLLM's neutral values (temperature 1, top_p 1, top_k off, ...)
    DIR    DIR/generation_config.json
    then --override-generation-config JSON on top (HF names: max_new_tokens, ...)

Of that file only the sampling fields count: temperature, top_p, top_k, min_p,
repetition_penalty, and max_new_tokens (vLLM's max_tokens for a request that
names none). `do_sample` is ignored, as vLLM ignores it. A max_new_tokens from
a DIR or from the override also caps every request's max_tokens (vLLM's
`override_max_tokens`). Built once at start-up into a frozen `SamplingDefaults`;
the API and the offline `LLM` read it, nothing patches the config.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from epd.transport.wire.sampling import SamplingParams

GENERATION_CONFIG = "generation_config.json"
GENERATION_CONFIG_MODES = ("auto", "vllm")  # or a directory
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
OVERRIDDEN_NOTE = ("Default sampling parameters have been overridden by the model's Hugging Face generation "
                   "config recommended from the model creator. If this is not intended, please relaunch with "
                   "`--generation-config vllm`.")


@dataclass(frozen=True)
class SamplingDefaults:
    """Defaults for omitted sampling fields; the class defaults are vLLM's neutral ones."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None  # for a request that names none (None: up to the model length)
    max_tokens_cap: int | None = None  # every request's max_tokens at most this (None: no cap)
    source: str = "vllm"  # where the values come from: a generation_config.json's path, or "vllm"

    def __post_init__(self) -> None:
        try:  # what SamplingParams refuses would make every request a 400: refuse it at start-up
            SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                           repetition_penalty=self.repetition_penalty, max_tokens=self.max_tokens)
        except ValueError as exc:
            raise ValueError(f"the default sampling parameters from {self.source}: {exc}") from None
        if self.max_tokens_cap is not None and self.max_tokens_cap < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_tokens_cap}")

    @classmethod
    def load(cls, model_dir: str | Path, generation_config: str = "auto",
             overrides: dict[str, Any] | None = None) -> SamplingDefaults:
        """vLLM's `get_diff_sampling_param`, as values. ValueError for a file that is
        not a JSON object, a DIR without the file, or a value sampling refuses."""
        overrides = dict(overrides or {})
        if generation_config == "vllm":
            values, source = {}, "vllm"
        else:
            directory = Path(model_dir) if generation_config == "auto" else Path(generation_config)
            path = directory / GENERATION_CONFIG
            if generation_config != "auto" and not path.is_file():
                raise ValueError(f"--generation-config {generation_config}: no {GENERATION_CONFIG} there")
            values = read_json_object(path) if path.is_file() else {}
            source = str(path) if path.is_file() else "vllm"
        values.update(overrides)
        if overrides:
            source = f"{source} + --override-generation-config"
        found = {k: values[k] for k in SAMPLING_KEYS if values.get(k) is not None}
        max_new = found.pop("max_new_tokens", None)
        # vLLM: a DIR's or an override's max_new_tokens also caps what a request asks
        cap_source = overrides if generation_config in GENERATION_CONFIG_MODES else values
        cap = cap_source.get("max_new_tokens")
        try:
            return cls(**{k: _typed(k, v) for k, v in found.items()}, max_tokens=_typed("max_new_tokens", max_new),
                       max_tokens_cap=_typed("max_new_tokens", cap), source=source)
        except TypeError as exc:
            raise ValueError(f"the default sampling parameters from {source}: {exc}") from None

    def overridden(self) -> dict[str, Any]:
        """The values that differ from vLLM's neutral ones, by vLLM's names ({}: neutral)."""
        neutral = SamplingDefaults()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("source", "max_tokens_cap") and getattr(self, f.name) != getattr(neutral, f.name)}

    def describe(self) -> str:
        """One line for the start-up log."""
        values = self.overridden()
        if not values:
            return "default sampling parameters: vLLM's neutral ones (temperature 1, top_p 1, top_k off)"
        shown = ", ".join(f"{k}={v}" for k, v in values.items())
        cap = f"; max_tokens at most {self.max_tokens_cap}" if self.max_tokens_cap is not None else ""
        return f"{OVERRIDDEN_NOTE} In force ({self.source}): {shown}{cap}"

    def max_tokens_for(self, requested: int | None) -> int | None:
        """The max_tokens of a request that asked `requested` (None: named none)."""
        max_tokens = self.max_tokens if requested is None else requested
        if self.max_tokens_cap is not None:
            max_tokens = self.max_tokens_cap if max_tokens is None else min(max_tokens, self.max_tokens_cap)
        return max_tokens

    def sampling_params(self) -> SamplingParams:
        """The offline `LLM`'s params when a call passes none (vLLM's `get_default_sampling_params`)."""
        values = {k: v for k, v in self.overridden().items() if k != "max_tokens"}
        max_tokens = self.max_tokens_for(None)
        return SamplingParams(**values, **({} if max_tokens is None else {"max_tokens": max_tokens}))


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file holding one object; ValueError naming the file otherwise."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} cannot be read as JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(value).__name__}")
    return value


def _typed(name: str, value: Any) -> Any:
    """The value as its field's type; TypeError naming the key for a non-number."""
    if value is None:
        return None
    integral = name in ("top_k", "max_new_tokens")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integral and value != int(value)):
        raise TypeError(f"{name} must be {'an integer' if integral else 'a number'}, got {value!r}")
    return int(value) if integral else float(value)
