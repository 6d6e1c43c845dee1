"""OpenAI request bodies -> GenerateRequest / RequestError, without a server."""
from __future__ import annotations

import pytest

from epd.api.protocol import (GenerateRequest, RequestError, check_max_tokens, check_model, fan_out, format_loc,
                              parse_chat_request, parse_completion_request, request_error_from_validation)
from epd.transport.wire.sampling import SamplingParams

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def chat(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def chat_request(max_images: int | None = None, **fields) -> GenerateRequest:
    return parse_chat_request(chat(**fields)).to_generate_request("chatcmpl-1", max_images_per_prompt=max_images)


def completion_request(**fields) -> GenerateRequest:
    return parse_completion_request({"model": "m", "prompt": "hello", **fields}).to_generate_request("cmpl-1")


def refused(make, **fields) -> RequestError:
    with pytest.raises(RequestError) as info:
        make(**fields)
    assert info.value.status == 400 and info.value.type == "invalid_request_error"
    return info.value


def test_defaults_follow_openai():
    chat_sampling = chat_request().sampling
    assert (chat_sampling.n, chat_sampling.temperature, chat_sampling.top_p, chat_sampling.top_k) == (1, 1.0, 1.0, -1)
    assert chat_sampling.max_tokens is None  # chat: up to the model length
    assert chat_sampling.logprobs is None and chat_sampling.stop == []
    assert completion_request().sampling.max_tokens == 16  # completions: OpenAI's default


def test_sampling_fields_and_vllm_extras_reach_sampling_params():
    s = chat_request(temperature=0, top_p=0.5, n=3, seed=7, presence_penalty=1.5, frequency_penalty=-1,
                     top_k=20, min_p=0.1, repetition_penalty=1.2, ignore_eos=True, min_tokens=2, max_tokens=9,
                     stop_token_ids=[5], skip_special_tokens=False, logprobs=True, top_logprobs=3).sampling
    assert s == SamplingParams(n=3, temperature=0.0, top_p=0.5, top_k=20, min_p=0.1, seed=7, presence_penalty=1.5,
                               frequency_penalty=-1.0, repetition_penalty=1.2, max_tokens=9, min_tokens=2,
                               stop_token_ids=[5], ignore_eos=True, logprobs=3, skip_special_tokens=False)


def test_max_completion_tokens_wins_over_max_tokens():
    assert chat_request(max_tokens=5, max_completion_tokens=8).sampling.max_tokens == 8
    assert chat_request(max_tokens=5).sampling.max_tokens == 5
    assert chat_request(max_completion_tokens=3).sampling.max_tokens == 3


def test_logprobs_without_top_logprobs_means_zero_alternatives():
    assert chat_request(logprobs=True).sampling.logprobs == 0
    assert chat_request(logprobs=False).sampling.logprobs is None
    assert completion_request(logprobs=2).sampling.logprobs == 2


@pytest.mark.parametrize("stop, expected", [(None, []), ("###", ["###"]), (["a", "b"], ["a", "b"])])
def test_stop_is_normalised_to_a_list(stop, expected):
    assert chat_request(stop=stop).sampling.stop == expected


@pytest.mark.parametrize("fields, param", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"presence_penalty": 2.1}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ({"seed": 2**63}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"top_k": -2}, "top_k"),  # SamplingParams' own check, mapped to a 400
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": 5, "max_tokens": 3}, "min_tokens"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"temperature": "hot"}, "temperature"),
    ({"stream": "maybe"}, "stream"),
    # logit_bias, tools and response_format are served now: their bad forms are refused
    ({"logit_bias": {"five": 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 101.0}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words[0]"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tool_choice": "required"}, "tool_choice"),  # without tools
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}],
      "tool_choice": "required"}, "tools"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": "ab"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs"),
    ({"model": ""}, "model"),
])
def test_invalid_sampling_values_are_refused_naming_the_field(fields, param):
    assert refused(chat_request, **fields).param == param


@pytest.mark.parametrize("messages, param", [
    ([], "messages"),
    ("hi", "messages"),
    ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
    ([{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}], "messages[0].tool_calls"),
    ([{"role": "user", "content": "a"}, {"role": "", "content": "b"}], "messages[1].role"),
    ([{"role": "user", "content": "a"}, {"role": 5, "content": "b"}], "messages[1].role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "data:x"}]}], "messages[0].content[0].image_url"),
    ([{"content": "no role"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "messages[0].content[0].text"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content[0].image_url.url"),
    ([{"role": "system", "content": [IMAGE]}], "messages[0].content[0].type"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}], "messages[0].tool_calls[0].function.name"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    (["not a dict"], "messages[0]"),
])
def test_bad_messages_are_refused_naming_the_field(messages, param):
    error = refused(chat_request, messages=messages)
    assert error.param == param and param in error.message


def test_messages_are_normalised():
    messages = [{"role": "developer", "content": "be brief"},
                {"role": "user", "name": "ann", "content": [{"type": "text", "text": "what is"}, IMAGE,
                                                           {"type": "image_url", "image_url": {"url": "data:x"}}]},
                {"role": "assistant", "content": None}]
    request = chat_request(messages=messages, add_generation_prompt=False)
    assert request.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "what is"}, IMAGE,
                                     {"type": "image_url", "image_url": {"url": "data:x"}}]},
        {"role": "assistant", "content": ""}]
    assert request.prompt is None and request.add_generation_prompt is False


def test_image_count_limit():
    messages = [{"role": "user", "content": [IMAGE, IMAGE]}]
    assert chat_request(max_images=2, messages=messages).messages[0]["content"] == [IMAGE, IMAGE]
    assert refused(chat_request, max_images=1, messages=messages).param == "messages"


@pytest.mark.parametrize("prompt, expected", [("hello", "hello"), ([1, 2, 3], [1, 2, 3]), (["one"], "one"),
                                              ([[4, 5]], [4, 5])])
def test_completion_prompts(prompt, expected):
    request = completion_request(prompt=prompt)
    assert request.prompt == expected and request.messages is None


@pytest.mark.parametrize("fields, param", [
    ({"prompt": ""}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": ["a"] * 257}, "prompt"),
    ({"prompt": [1, -1]}, "prompt"), ({"prompt": {"x": 1}}, "prompt"), ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"suffix": "x"}, "suffix"), ({"max_tokens": 0}, "max_tokens"),
])
def test_bad_completion_requests(fields, param):
    assert refused(completion_request, **fields).param == param


def test_missing_required_fields():
    with pytest.raises(RequestError) as info:
        parse_chat_request({"messages": [{"role": "user", "content": "x"}]})
    assert (info.value.param, info.value.message) == ("model", "model: field required")
    with pytest.raises(RequestError) as info:
        parse_completion_request({"model": "m"})
    assert info.value.param == "prompt"


def test_unknown_fields_are_ignored_like_vllm():
    assert chat_request(metadata={"a": 1}, store=False).sampling.n == 1


def test_unknown_model_is_404():
    check_model("served", "served")
    with pytest.raises(RequestError) as info:
        check_model("other", "served")
    assert (info.value.status, info.value.type, info.value.code, info.value.param) == (
        404, "not_found_error", "model_not_found", "model")


def test_request_error_types_follow_the_status():
    assert RequestError("x", status=422).status == 400
    assert RequestError("x", status=401).type == "authentication_error"
    assert RequestError("x", status=413).type == "invalid_request_error"
    assert RequestError("x", status=500).type == "server_error"
    assert RequestError("x", status=400, type="custom").type == "custom"


def test_validation_error_conversion():
    assert format_loc(("body", "messages", 0, "content", 1, "type")) == "messages[0].content[1].type"
    error = request_error_from_validation([{"type": "json_invalid", "loc": ("body", 3), "msg": "JSON decode error",
                                            "ctx": {"error": "Expecting value"}}])
    assert error.message == "Invalid JSON body: Expecting value" and error.status == 400
    with pytest.raises(RequestError) as info:
        parse_chat_request([1, 2])
    assert info.value.param is None and "JSON object" in info.value.message


def test_fan_out_gives_distinct_ids_and_consecutive_seeds():
    request = chat_request(n=3, seed=10)
    children = fan_out(request)
    assert [c.request_id for c in children] == ["chatcmpl-1-0", "chatcmpl-1-1", "chatcmpl-1-2"]
    assert [c.sampling.seed for c in children] == [10, 11, 12]
    assert all(c.sampling.n == 1 and c.messages == request.messages for c in children)
    assert [c.sampling.seed for c in fan_out(chat_request(n=2))] == [None, None]
    single = chat_request()
    assert fan_out(single) == [single]


# -- vLLM 0.32's rules (tests/e2e/api/test_vllm_conformance.py asks them of a real server) ----------

def test_completion_max_tokens_null_is_the_default_and_zero_needs_echo():
    assert completion_request(max_tokens=None).sampling.max_tokens == 16  # vLLM: null is the default
    body = parse_completion_request({"model": "m", "prompt": "hello", "max_tokens": 0, "echo": True})
    assert body.echo_only and body.to_generate_request("cmpl-1").sampling.max_tokens == 1  # one token, not shown
    assert "at least 1" in refused(completion_request, max_tokens=0).message


def test_max_tokens_past_the_model_length_is_refused_naming_the_field():
    check_max_tokens(None, "max_tokens", 64)
    check_max_tokens(64, "max_tokens", 64)  # fits the context: cut to the room beside the prompt later
    with pytest.raises(RequestError) as info:
        check_max_tokens(65, "max_completion_tokens", 64)
    assert info.value.param == "max_completion_tokens"
    assert info.value.message.startswith("max_completion_tokens=65 cannot be greater than max_model_len=64")


def test_empty_stream_options_without_stream_are_no_options():
    assert chat_request(stream_options={}).sampling.n == 1
    assert refused(chat_request, stream_options={"continuous_usage_stats": True}).param == "stream_options"


def test_tools_must_not_be_empty_and_every_bad_logit_bias_key_is_named():
    assert refused(chat_request, tools=[]).param == "tools"
    error = refused(chat_request, logit_bias={"bad1": 1.0, "5": 1.0, "bad2": 2.0})
    assert error.param == "logit_bias" and "'bad1'" in error.message and "'bad2'" in error.message


def test_validation_messages_carry_pydantics_error_type():
    error = refused(chat_request, seed=2**63)
    assert error.param == "seed" and "[type=less_than_equal]" in error.message
