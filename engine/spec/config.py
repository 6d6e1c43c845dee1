"""`--speculative-config` / `LLM(speculative_config=...)`: vLLM's JSON, typed.

    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "eagle3", "model": "/path/to/head", "num_speculative_tokens": 3}

    {"method": "draft_model", "model": "/ckpt/small", "num_speculative_tokens": 3}
    {"method": "mtp", "num_speculative_tokens": 3}      (the target's own MTP layers)

Keys and defaults are vLLM's (`vllm/config/speculative.py`): `method` may be
left out when `model` is "ngram" or "[ngram]" (any other `model`: a draft model); an n-gram config without
`prompt_lookup_min` and `prompt_lookup_max` takes 5 for both, one without the
other takes the other's value, and min must not exceed max. EPD bounds
`num_speculative_tokens` (<= MAX_SPECULATIVE_TOKENS) and the lookups
(<= MAX_PROMPT_LOOKUP), which vLLM does not. Methods EPD does
not run yet (medusa, ...) and keys it does not read are refused
with a ValueError that names them: a flag that would silently not speculate
is worse than one that stops start-up.

Pure Python (no torch): the CLI and the scheduler's tests read it.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from epd.transport.wire.flag_json import json_object

METHODS = ("ngram", "eagle3", "draft_model", "mtp")  # served now
# vLLM's older spellings of a method -> the method
ALIASES = {"[ngram]": "ngram", "qwen3_5_mtp": "mtp", "qwen3_next_mtp": "mtp"}
MODEL_METHODS = ("eagle3", "draft_model")  # need `model`: the head's or the draft's directory
VLLM_METHODS = ("ngram", "eagle", "eagle3", "draft_model", "medusa", "mlp_speculator", "mtp", "suffix")
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model")
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's, when neither bound is given
# Upper bounds (vLLM sets none): each draft token is a row of every verify step, sized for at
# start-up (max_num_seqs x (1 + k) rows), and published heads and n-gram settings use k <= 10 and
# lookups <= 10; past these a "speculation" costs memory and time and accepts nothing more.
MAX_SPECULATIVE_TOKENS = 32
MAX_PROMPT_LOOKUP = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """How a decode-side engine speculates: `num_speculative_tokens` (k) draft
    tokens a step per greedy sequence, verified in one forward of the target.
    n-gram: the draft is what followed the longest earlier match (length in
    [prompt_lookup_min, prompt_lookup_max]) of the sequence's own suffix.
    eagle3: `model` is an EAGLE-3 head in Speculators' format (engine/spec/eagle3.py),
    drafting from the target's hidden states (engine/spec/eagle3_proposer.py).
    draft_model: the greedy continuation of `model`, a checkpoint directory with
    the target's tokenizer (engine/spec/draft_model.py).
    mtp: the target checkpoint's own MTP layers (engine/spec/mtp.py); "qwen3_5_mtp" and
    "qwen3_next_mtp" are read as "mtp"."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            known = "one of vLLM's methods, not served by EPD yet" if self.method in VLLM_METHODS \
                else "not a speculative method"
            raise ValueError(f"--speculative-config: method {self.method!r} is {known}; "
                             f"EPD speculates with {', '.join(METHODS)}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):  # max: the one given
            value = getattr(self, name)
            limit = MAX_SPECULATIVE_TOKENS if name == "num_speculative_tokens" else MAX_PROMPT_LOOKUP
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
                raise ValueError(f"--speculative-config: {name} must be an integer from 1 to {limit}, "
                                 f"got {value!r}")
        if self.method in MODEL_METHODS and not (isinstance(self.model, str) and self.model):
            raise ValueError(f'--speculative-config: method "{self.method}" needs "model", the draft\'s directory')
        if self.method == "draft_model" and not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"--speculative-config: the draft model {self.model!r} is not a checkpoint "
                             "directory (no config.json)")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"--speculative-config: prompt_lookup_min={self.prompt_lookup_min} must be <= "
                             f"prompt_lookup_max={self.prompt_lookup_max}")

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From the flag's JSON text, a dict (`LLM`), or itself; None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object("--speculative-config", value)
        unknown = sorted(set(value) - set(KEYS))
        if unknown:
            raise ValueError(f"--speculative-config: EPD does not read {', '.join(unknown)} "
                             f"(it takes {', '.join(KEYS)})")
        fields = dict(value)
        method = fields.pop("method", None)
        if method is None:  # vLLM infers it from the model name
            method = "ngram" if fields.get("model") in ("ngram", "[ngram]") else "draft_model"
        method = ALIASES.get(method, method)
        if "num_speculative_tokens" not in fields:
            raise ValueError("--speculative-config: num_speculative_tokens is required")
        low, high = fields.pop("prompt_lookup_min", None), fields.pop("prompt_lookup_max", None)
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        low, high = (high if low is None else low), (low if high is None else high)
        return cls(method=method, prompt_lookup_min=low, prompt_lookup_max=high, **fields)

    def to_json(self) -> str:
        """vLLM's JSON for this config (what `parse` reads back)."""
        return json.dumps(asdict(self))
