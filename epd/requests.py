"""The types the serving layer speaks: what the HTTP edge (epd/api) hands the
orchestrator (epd/serve) and what it gets back.

    GenerateRequest   one sequence to generate (the edge fans `n > 1` out)
    Delta             new output of that sequence since the previous Delta
    RequestError      a request refused, rendered by the edge as an OpenAI error body
    ToolChoice        what the edge parses out of a chat answer (carried, not read, here)

Neither side owns them, so both import them from here and neither imports the
other for them. Importing this module loads no torch (tests/unit/repo/test_layering.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from epd.transport.wire.lora_request import LoRARequest
from epd.transport.wire.sampling import SamplingParams, TokenLogprobs

_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}


class RequestError(Exception):
    """A request we refuse; rendered as `{"error": {message, type, param, code}}`.

    `status` 422 is folded into 400 (OpenAI never answers 422). `type` follows
    the status unless given: 401 authentication_error, 404 not_found_error,
    other 4xx invalid_request_error, 5xx server_error.
    """

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 code: str | None = None, type: str | None = None, retry_after_s: int | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s  # sent as Retry-After (a 503 the client may try again)
        self.status = 400 if status == 422 else status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _ERROR_TYPES.get(
            self.status, "server_error" if self.status >= 500 else "invalid_request_error")


@dataclass(frozen=True)
class ToolChoice:
    """What to parse out of a chat answer: mode "none", "auto", "required" or "named"."""

    mode: str
    name: str | None = None  # the function, mode "named"


@dataclass
class GenerateRequest:
    """One sequence to generate. Exactly one of `messages` (chat, validated OpenAI
    message dicts, see `validate_messages`) and `prompt` (completions) is set."""

    request_id: str
    messages: list[dict] | None
    prompt: str | list[int] | None
    sampling: SamplingParams
    add_generation_prompt: bool = True
    tools: list[dict] | None = None  # rendered by the chat template
    tool_choice: ToolChoice | None = None  # how the answer is parsed into tool calls (chat only)
    truncate_prompt_tokens: int | None = None  # keep this many prompt tokens (-1: as many as fit), vLLM's
    truncation_side: str = "left"  # left: keep the last ones; right: the first
    add_special_tokens: bool = False  # a completion's text prompt: the tokenizer's BOS / EOS added
    continue_final_message: bool = False  # chat: the last message rendered open (vLLM's)
    chat_template_kwargs: dict | None = None  # chat: more variables for the template (vLLM's), e.g. enable_thinking
    lora: LoRARequest | None = None  # the adapter the request's `model` names (None: the base model)
    mm_processor_kwargs: dict | None = None  # chat: the video processor's settings (vLLM's), checked at the edge
    session_id: str | None = None  # its conversation, for --router cache_aware: x-session-id, else `user`


@dataclass
class Delta:
    """New output of one sequence since the previous Delta; the last one has
    `finish_reason` set ("stop", "length", or "abort": a worker failed it after
    tokens were streamed)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None  # one per token in token_ids, when asked
    dispatched_s: float | None = None  # time.monotonic() when the request was handed to a prefill worker
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it (None: EOS)
    prompt_token_ids: list[int] | None = None  # the prompt as prefilled, on the sequence's first Delta
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 1..n-1, on the first Delta, when asked
