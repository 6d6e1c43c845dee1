"""epd/api/vllm_fields.py: every field of vLLM's ChatCompletionRequest and
CompletionRequest is served, ignored as vLLM ignores it, or refused (unless at
vLLM's default); the rest are logged once."""
from __future__ import annotations

import logging

import pytest

from epd.api import vllm_fields
from epd.api.protocol import ChatCompletionRequest, CompletionRequest, RequestError, parse_completion_request
from epd.api.vllm_fields import (AS_VLLM_IGNORES, REFUSED_CHAT, REFUSED_COMPLETION, SERVED_CHAT, SERVED_COMPLETION,
                                 UnknownFields)

# vLLM's request fields, as its protocol modules declare them
# (vllm/entrypoints/openai/chat_completion/protocol.py, completion/protocol.py).
_VLLM_COMMON = [
    "model", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty", "seed", "stop",
    "stream", "stream_options", "temperature", "top_p", "user", "use_beam_search", "top_k", "min_p",
    "repetition_penalty", "watermarking", "length_penalty", "stop_token_ids", "include_stop_str_in_output",
    "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "truncation_side", "prompt_logprobs", "logprob_token_ids", "allowed_token_ids", "bad_words", "response_format",
    "structured_outputs", "priority", "request_id", "session_id", "return_tokens_as_token_ids", "return_token_ids",
    "routed_experts_prompt_start", "return_token_offsets", "return_mm_kwargs", "cache_salt", "kv_transfer_params",
    "ec_transfer_params", "vllm_xargs", "repetition_detection", "thinking_token_budget", "stream_interval",
    "add_special_tokens", "echo"]
VLLM_CHAT = _VLLM_COMMON + [
    "messages", "top_logprobs", "max_completion_tokens", "tools", "tool_choice", "reasoning_effort",
    "include_reasoning", "parallel_tool_calls", "add_generation_prompt", "continue_final_message", "documents",
    "chat_template", "chat_template_kwargs", "media_io_kwargs", "mm_processor_kwargs", "return_prompt_text"]
VLLM_COMPLETION = _VLLM_COMMON + ["prompt", "suffix", "prompt_embeds"]


@pytest.mark.parametrize("model, vllm, served, refused", [
    (ChatCompletionRequest, VLLM_CHAT, SERVED_CHAT, REFUSED_CHAT),
    (CompletionRequest, VLLM_COMPLETION, SERVED_COMPLETION, REFUSED_COMPLETION)], ids=["chat", "completions"])
def test_every_vllm_field_has_one_place(model, vllm, served, refused):
    for name in vllm:
        places = [name in served, name in refused, name in AS_VLLM_IGNORES]
        assert places.count(True) == 1, (name, places)
    declared = set(model.model_fields)
    assert served <= declared, served - declared  # served fields are real model fields
    assert not declared & set(refused)  # a refused one is never parsed as if served
    assert not (declared - served - AS_VLLM_IGNORES), declared - served  # nothing declared and unaccounted for


def completion(**fields):
    return parse_completion_request({"model": "m", "prompt": "hi", **fields}).to_generate_request("r")


@pytest.mark.parametrize("field, value", [("use_beam_search", True), ("logprob_token_ids", [3]), ("priority", 1),
                                          ("length_penalty", 2.0), ("spaces_between_special_tokens", False),
                                          ("thinking_token_budget", 10), ("priority", False),
                                          ("watermarking", True)])
def test_refused_values_name_their_field(field, value):
    with pytest.raises(RequestError) as info:
        completion(**{field: value})
    assert (info.value.status, info.value.param) == (400, field)
    assert info.value.message.startswith(f"{field}: ")


def test_vllm_defaults_and_ignored_fields_pass():
    completion(use_beam_search=False, prompt_logprobs=None, priority=0, length_penalty=1.0,
               thinking_token_budget=-1, user="x", return_token_offsets=True, return_mm_kwargs=False)


def test_unknown_fields_are_logged_once_per_name(caplog, monkeypatch):
    monkeypatch.setattr(vllm_fields, "UNKNOWN", UnknownFields())
    with caplog.at_level(logging.WARNING, logger="epd.api.vllm_fields"):
        for _ in range(3):
            completion(zz_one=1, zz_two=2)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and any("'zz_one'" in m for m in messages) and any("'zz_two'" in m for m in messages)
