"""Every request field vLLM's /v1/chat/completions and /v1/completions know,
accounted for: no field vLLM knows is silently ignored.

    served     declared on the request models (epd/api/protocol.py) and served
               as vLLM serves them; `SERVED_*` names them, a test checks each
               one is a model field
    ignored    fields vLLM itself ignores on these endpoints (`AS_VLLM_IGNORES`):
               accepted, no effect, as there
    refused    `REFUSED_*`: a value other than vLLM's default is a 400 naming
               the field and saying why; vLLM's default is accepted (clients
               that spell every default out keep working)
    unknown    a field neither vLLM nor OpenAI's client sends to vLLM: logged
               once per name (vLLM warns on each request), then ignored; 200

The names are vLLM's request models (vllm/entrypoints/openai/chat_completion/
protocol.py and completion/protocol.py); docs/architecture.md carries the table.
"""
from __future__ import annotations

import logging
from typing import Any

from epd.requests import RequestError

logger = logging.getLogger(__name__)

_BEAM = "beam search is not supported (sample with n, or use temperature 0)"
_ROUTING = "EPD has no KV / encoder-cache connector for it (its own workers move KV and embeddings)"

# Both endpoints: name -> (vLLM's default values, why EPD refuses another value)
REFUSED_COMMON: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), _BEAM),
    "length_penalty": ((1.0, 1), "length_penalty applies to beam search, which is not supported"),
    "watermarking": ((None, False), "watermarking is not supported"),
    "spaces_between_special_tokens": ((True,), "special tokens are always decoded without spaces between them"),
    "logprob_token_ids": ((None,), "logprobs of chosen token ids are not supported; use logprobs / top_logprobs"),
    "priority": ((0,), "priority scheduling is not enabled (vLLM refuses it the same way without "
                       "--scheduling-policy priority)"),
    "request_id": ((None,), "a client-chosen request id is not supported: send the X-Request-Id header"),
    "session_id": ((None,), "session ids are not supported"),
    "cache_salt": ((None,), "prefix-cache salting is not supported"),
    "kv_transfer_params": ((None,), _ROUTING),
    "ec_transfer_params": ((None,), _ROUTING),
    "vllm_xargs": ((None,), "custom extension arguments are not supported"),
    "repetition_detection": ((None,), "repetition detection is not supported"),
    "thinking_token_budget": ((None, -1), "thinking budgets need a reasoning parser, which EPD does not have"),
    "routed_experts_prompt_start": ((0,), "EPD serves no mixture-of-experts model"),
    "prompt_embeds": ((None,), "prompt embeddings are not accepted"),
}

REFUSED_CHAT: dict[str, tuple[tuple[Any, ...], str]] = {
    **REFUSED_COMMON,
    "reasoning_effort": ((None,), "reasoning effort needs a reasoning model's template switch, not supported"),
    "parallel_tool_calls": ((None, True), "every tool call the model makes is returned"),
    "add_special_tokens": ((False,), "the chat template adds the special tokens"),
    "documents": ((None,), "documents (RAG templates) are not supported"),
    "chat_template": ((None,), "a per-request chat template is not trusted (vLLM refuses it too without "
                               "--trust-request-chat-template); set --chat-template"),
    "media_io_kwargs": ((None,), "per-request media loading arguments are not supported"),
    "return_prompt_text": ((None, False), "the rendered prompt text is not returned; POST /tokenize gives its tokens"),
}

REFUSED_COMPLETION: dict[str, tuple[tuple[Any, ...], str]] = {
    **REFUSED_COMMON,
    "suffix": ((None,), "suffix (fill-in-the-middle) is not supported"),
}

# Fields vLLM accepts and ignores on these endpoints (its own comments say so): the same here.
AS_VLLM_IGNORES = frozenset({
    "user",  # "NOTE this will be ignored by vLLM" (EPD's --router cache_aware keys sessions by it)
    "return_token_offsets", "return_mm_kwargs",  # only the /render endpoints read them
    "include_reasoning",  # only with a --reasoning-parser, which EPD does not have
})

SERVED_COMMON = frozenset({
    "model", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "max_tokens", "n", "seed",
    "stop", "stream", "stream_options", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "truncate_prompt_tokens", "truncation_side", "allowed_token_ids", "bad_words", "structured_outputs",
    "response_format", "echo", "return_token_ids", "stream_interval", "prompt_logprobs",
    "return_tokens_as_token_ids",
})
SERVED_CHAT = SERVED_COMMON | {"messages", "top_logprobs", "max_completion_tokens", "tools", "tool_choice",
                               "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
                               "mm_processor_kwargs"}
SERVED_COMPLETION = SERVED_COMMON | {"prompt", "add_special_tokens"}


class UnknownFields:
    """The names of unknown fields already logged (once each per process)."""

    def __init__(self) -> None:
        self.logged: set[str] = set()

    def note(self, names) -> None:
        for name in names:
            if name not in self.logged:
                self.logged.add(name)
                logger.warning("request field %r is not one vLLM or EPD knows: ignored (logged once)", name)


UNKNOWN = UnknownFields()


def check_extra_fields(extra: dict[str, Any] | None, refused: dict[str, tuple[tuple[Any, ...], str]]) -> None:
    """The fields a request model did not declare: a refused one set to another
    value than vLLM's default is a 400 naming it; an unknown one is logged once."""
    unknown = []
    for name, value in (extra or {}).items():
        if name in refused:
            defaults, why = refused[name]
            if not any(type(value) is type(d) and value == d for d in defaults):
                raise RequestError(f"{name}: {why}", param=name)
        elif name not in AS_VLLM_IGNORES:
            unknown.append(name)
    if unknown:
        UNKNOWN.note(unknown)
