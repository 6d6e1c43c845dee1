"""What to sample and what came out: `SamplingParams` and `TokenLogprobs`.

Both are built by users of the engine (the API, the offline `LLM`), read by the
sampler, and cross the wire inside PrefillRequest, KVTransfer and TokenOutput
(their msgpack forms are written out in messages.py). Pure Python, no torch:
the scheduler imports this and its tests check it stays torch-free.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output, as vLLM names it: exactly one of `json` (a JSON
    schema, as a dict or its text), `json_object` (any JSON object), `regex`,
    `choice` (one of these strings) or `grammar` (EBNF, xgrammar's dialect).

    The engine compiles it into a token mask (engine/structured_output.py);
    here it is only checked for shape. `key` names the compiled grammar:
    equal keys compile once per worker.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        for name, kind in (("regex", str), ("grammar", str), ("choice", list), ("json_object", bool)):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), kind):
                raise ValueError(f"structured_outputs.{name} must be a {kind.__name__}")
        kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k)]
        if len(kinds) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar, "
                             f"json_object; got {kinds or 'none'}")
        if self.choice is not None:
            if not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice must be a list of strings")
            object.__setattr__(self, "choice", list(self.choice))
        if isinstance(self.json, str):
            try:
                value = json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            if not isinstance(value, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema object")
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError("structured_outputs.json must be a JSON schema (dict or JSON text)")

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k))

    @property
    def spec(self) -> str:
        """The constraint as one string: the schema's JSON text, the regex, the
        choices as a JSON list, the grammar; "" for json_object."""
        kind = self.kind
        if kind == "json":
            return self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
        if kind == "choice":
            return json.dumps(self.choice)
        if kind == "json_object":
            return ""
        return getattr(self, kind)

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.spec

    def to_map(self) -> dict[str, Any]:
        return {"kind": self.kind, "spec": self.spec}

    @staticmethod
    def from_kind(kind: str, spec: str) -> StructuredOutputsParams:
        """The inverse of `to_map`; ValueError for an unknown kind."""
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        if kind == "choice":
            try:
                return StructuredOutputsParams(choice=json.loads(spec))
            except (ValueError, TypeError):
                raise ValueError("structured_outputs.choice must be a JSON list of strings") from None
        if kind == "json":
            try:
                schema = json.loads(spec)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            return StructuredOutputsParams(json=schema if isinstance(schema, dict) else spec)
        if kind not in ("regex", "grammar"):
            raise ValueError(f"unknown structured_outputs kind {kind!r}")
        return StructuredOutputsParams(**{kind: spec})


@dataclass
class SamplingParams:
    """What to sample and when to stop, with vLLM's names and defaults.

    `temperature == 0` means greedy. `max_tokens=None` means "up to the model
    length". `stop` strings are matched on detokenized text and never appear in
    the output; `stop_token_ids` and EOS end a request with the token kept in
    `token_ids` but not in `text`.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (vLLM's)
    skip_special_tokens: bool = True
    # Logits controls: OpenAI's logit_bias (token id -> added to its logit, in
    # [-100, 100]); vLLM's allowed_token_ids (only these may be sampled) and
    # bad_words (never produced; the engine tokenizes them, with and without a
    # leading space).
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    structured_outputs: StructuredOutputsParams | None = None
    # Delivery, not sampling (like vLLM's output_kind): a served stream's tokens
    # leave the worker every `stream_interval` tokens, the first and the last at
    # once (`epd serve --stream-interval`, set by the API); the offline LLM ignores it.
    stream_interval: int = 1
    # Read where the text is made (the API's detokenizer, the offline LLM's), not by the engine.
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()} or None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.bad_words = list(self.bad_words or [])
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the first invalid field."""
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {self.stream_interval}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        for token_id, bias in (self.logit_bias or {}).items():
            if token_id < 0:
                raise ValueError(f"logit_bias token ids must be non-negative, got {token_id}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
            if any(t < 0 for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must be non-negative token ids")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise ValueError("bad_words must be non-empty strings")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprobs of one sampled token under the raw model distribution.

    `rank` is 1 for the most likely token; `top` holds the `logprobs=k` most
    likely (token id, logprob) pairs, most likely first (empty when k == 0).
    """

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]
