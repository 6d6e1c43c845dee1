"""vLLM's own chat-completion tests, re-asked of EPD in every mode (issue 31, "Tests");
the completions half, and what the two share, are in test_vllm_conformance.py."""
from __future__ import annotations

import httpx
import pytest
from testkit.mode_servers import MODES
from testkit.vllm_conformance import MESSAGES, MODEL, chat, chat_prompt_ids, client, refused, tokenizer  # noqa: F401 (fixtures)

pytestmark = pytest.mark.parametrize("mode_server", MODES, indirect=True)


@pytest.fixture(scope="module")
def vocab_size(tiny_model) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_model).get_text_config().vocab_size


def test_return_token_ids_chat(client, tokenizer):
    # basic/test_return_token_ids.py::test_chat_completion_with_emoji_and_token_ids, test_chat_completion_with_tool_use
    messages = [{"role": "system", "content": "You like to use emojis in your responses."},
                {"role": "user", "content": "Repeat after me: I love cats 🐱"}]
    r = chat(client, messages, max_tokens=8, logprobs=True, extra={"return_token_ids": True})
    prompt = tokenizer.decode(r.model_extra["prompt_token_ids"])
    assert "You like to use emojis in your responses" in prompt and "I love cats 🐱" in prompt
    assert r.choices[0].model_extra["token_ids"] and r.choices[0].message.content is not None
    chunks = list(chat(client, messages, max_tokens=8, stream=True, extra={"return_token_ids": True}))
    assert tokenizer.decode(chunks[0].model_extra["prompt_token_ids"]) == prompt  # on the first chunk, and
    assert all("prompt_token_ids" not in c.model_dump() for c in chunks[1:])  # on no other
    streamed = [t for c in chunks if c.choices and "token_ids" in c.choices[0].model_dump()
                for t in c.choices[0].model_extra["token_ids"]]
    assert streamed == r.choices[0].model_extra["token_ids"]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}}]
    for asked in (True, False):
        r = chat(client, messages, max_tokens=8, tools=tools, tool_choice="auto", logprobs=True,
                 extra={"return_token_ids": asked})
        assert (r.model_extra["prompt_token_ids"] is not None) == asked
        assert (r.choices[0].model_extra["token_ids"] is not None) == asked


# -- /v1/chat/completions: chat_completion/test_chat.py -----------------------------------------------

@pytest.mark.parametrize("top_logprobs", [None, 0, 5])
def test_chat_logprobs_counts(client, top_logprobs):
    # chat_completion/test_chat.py::test_no_logprobs_chat, test_zero_logprobs_chat, test_some_logprobs_chat
    if top_logprobs is None:
        assert chat(client, logprobs=False).choices[0].logprobs is None
        return
    content = chat(client, logprobs=True, top_logprobs=top_logprobs).choices[0].logprobs.content
    assert len(content) == 5 and all(len(e.top_logprobs) == top_logprobs for e in content)
    streamed = [e for c in chat(client, logprobs=True, top_logprobs=top_logprobs, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, len(e.top_logprobs)) for e in streamed] == [(e.token, top_logprobs) for e in content]


@pytest.mark.parametrize("k", [1, 0, -1, None])
def test_prompt_logprobs_chat(client, k):
    # chat_completion/test_chat.py::test_prompt_logprobs_chat, test_more_than_one_prompt_logprobs_chat
    messages = [*MESSAGES, {"role": "assistant", "content": "2"}, {"role": "user", "content": "Where was it played?"}]
    if k is not None and k < 0:
        refused(lambda: chat(client, messages, max_tokens=1, extra={"prompt_logprobs": k}))
        return
    r = chat(client, messages, max_tokens=1, extra={} if k is None else {"prompt_logprobs": k})
    steps = r.model_extra["prompt_logprobs"]
    if k is None:
        assert steps is None
    else:  # the prompt token and the top k (the same one when it is the top 1)
        assert steps and steps[0] is None and all(k <= len(s) <= k + 1 for s in steps[1:])


def test_single_chat_session(client, tokenizer):
    # chat_completion/test_chat.py::test_single_chat_session
    messages = list(MESSAGES)
    r = chat(client, messages, logprobs=True, top_logprobs=5)
    num_prompt = len(chat_prompt_ids(tokenizer, messages))
    assert r.id and len(r.choices) == 1 and r.choices[0].finish_reason == "length"
    assert (r.usage.completion_tokens, r.usage.prompt_tokens, r.usage.total_tokens) == (5, num_prompt, num_prompt + 5)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    messages += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": "express your result in json"}]
    assert chat(client, messages).choices[0].message.content is not None


def test_chat_streaming(client):
    # chat_completion/test_chat.py::test_chat_streaming
    whole = chat(client, max_tokens=10).choices[0]
    chunks = list(chat(client, max_tokens=10, stream=True))
    assert all(c.choices[0].delta.role in (None, "assistant") for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert sum(c.choices[0].finish_reason is not None for c in chunks) == 1
    last = chunks[-1].choices[0]
    assert last.finish_reason == whole.finish_reason and last.delta.content
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.message.content


def test_chat_completion_stream_options(client):
    # chat_completion/test_chat.py::test_chat_completion_stream_options
    def stream(options, **kwargs):
        return list(chat(client, max_tokens=10, stream=True, stream_options=options, **kwargs))

    assert all(c.usage is None for c in stream({"include_usage": False}))
    chunks = stream({"include_usage": True, "continuous_usage_stats": False})
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-2].choices[0].finish_reason is not None
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens > 0 and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    for options in ({"include_usage": None}, {"include_usage": True}):
        refused(lambda: chat(client, max_tokens=10, stream=False, stream_options=options))
    last = 0
    for c in stream({"include_usage": True, "continuous_usage_stats": True}, extra={"min_tokens": 10}):
        assert c.usage.prompt_tokens >= 0 and c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
        assert last == 0 or c.usage.completion_tokens > last or (not c.choices and c.usage.completion_tokens == last)
        last = c.usage.completion_tokens
    assert last == 10


def test_chat_message_forms(client):
    # chat_completion/test_chat.py::test_extra_fields_allowed, test_complex_message_content, test_custom_role
    text = "what is 1+1?"
    assert chat(client, [{"role": "user", "content": text, "extra_field": "0"}], seed=0).choices[0].message.content
    as_string = chat(client, [{"role": "user", "content": text}]).choices[0].message.content
    as_parts = chat(client, [{"role": "user", "content": [{"type": "text", "text": text}]}]).choices[0].message.content
    assert as_string == as_parts
    custom = [chat(client, [{"role": "my-custom-role", "content": content}], seed=0).choices[0].message.content
              for content in (text, [{"type": "text", "text": text}])]
    assert custom[0] == custom[1]


def test_long_seed(client):
    # chat_completion/test_chat.py::test_long_seed
    for seed in (-(2**63) - 1, 2**63):
        system = [{"role": "system", "content": "You are a helpful assistant."}]
        error = refused(lambda: chat(client, system, seed=seed))
        assert "greater_than_equal" in error.message or "less_than_equal" in error.message


def test_chat_n(client):
    # chat_completion/test_chat.py::test_chat_completion_n_parameter_non_streaming, _streaming,
    # test_chat_completion_n_with_seed, test_chat_completion_n_equals_1
    r = chat(client, max_tokens=8, temperature=0.7, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2] and all(c.message.content for c in r.choices)
    assert len({c.message.content for c in r.choices}) > 1
    by_index: dict[int, str] = {}
    for chunk in chat(client, max_tokens=8, temperature=0.7, n=2, stream=True):
        for choice in chunk.choices:
            by_index[choice.index] = by_index.get(choice.index, "") + (choice.delta.content or "")
    assert sorted(by_index) == [0, 1] and all(by_index.values())
    seeded = chat(client, max_tokens=8, temperature=0.8, n=2, seed=42)
    assert [c.index for c in seeded.choices] == [0, 1] and all(c.message.content for c in seeded.choices)
    assert len(chat(client, temperature=0.7, n=1).choices) == 1


@pytest.mark.parametrize("echo", [True, False])
def test_chat_echo_with_continue_final_message(client, echo):
    # chat_completion/test_chat_echo.py::test_chat_session_with_echo_and_continue_final_message
    saying = "Here is a common saying about apple. An apple a day, keeps"
    r = chat(client, [{"role": "user", "content": "tell me a common saying"}, {"role": "assistant", "content": saying}],
             extra={"echo": echo, "continue_final_message": True, "add_generation_prompt": False})
    message = r.choices[0].message
    assert message.role == "assistant" and (saying in message.content) == echo


def test_structured_outputs_logprobs_floor(client):
    # chat_completion/test_chat.py::test_structured_outputs_choice_chat_logprobs (-9999.0 is OpenAI's floor)
    r = chat(client, max_tokens=10, logprobs=True, top_logprobs=5,
             extra={"structured_outputs": {"choice": ["Python", "Java", "Rust"]}, "ignore_eos": False})
    assert r.choices[0].message.content in ("Python", "Java", "Rust")
    assert all(t.logprob >= -9999.0 for t in r.choices[0].logprobs.content[0].top_logprobs)


# -- validation of token ids and tools: chat_completion/test_chat_*_validation.py, test_tool_choice_null.py ---

def test_logit_bias_validation(client, vocab_size):
    # chat_completion/test_chat_logit_bias_validation.py (every test)
    assert chat(client, logit_bias={str(vocab_size - 1): 1.0}).choices[0].message.content is not None
    error = refused(lambda: chat(client, logit_bias={str(vocab_size + 1): 1.0}))
    assert str(vocab_size + 1) in error.message and str(vocab_size) in error.message
    error = refused(lambda: chat(client, logit_bias={"not_a_token_id": 50}))
    assert "not_a_token_id" in error.message and "logit_bias" in error.message
    assert "logit_bias" in refused(lambda: chat(client, logit_bias={"1": "not_a_number"})).message
    error = refused(lambda: chat(client, logit_bias={"bad1": 50.0, "bad2": 20.0}))
    assert "bad1" in error.message and "bad2" in error.message


def test_stop_token_ids_validation(client, vocab_size):
    # chat_completion/test_chat_stop_token_ids_validation.py (every test)
    assert chat(client, extra={"stop_token_ids": [vocab_size - 1]}).choices[0].message.content is not None
    error = refused(lambda: chat(client, extra={"stop_token_ids": [vocab_size + 1]}))
    assert str(vocab_size + 1) in error.message and str(vocab_size) in error.message
    refused(lambda: chat(client, extra={"stop_token_ids": [-1]}))


def test_tool_choice_validation(client, mode_server):
    # chat_completion/test_tool_choice_null.py (every test); chat_completion/protocol.py's check_tool_usage
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
                                                                                       "properties": {}}}}]

    def post(**fields) -> httpx.Response:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **fields}
        return httpx.post(mode_server.base_url + "/v1/chat/completions", json=body, timeout=120)

    assert post(tools=tools, tool_choice=None).status_code == 200
    assert post(tool_choice=None).status_code == 200
    assert post(tool_choice=None, structured_outputs={"json": {"type": "object"}}).status_code == 200
    assert post(tools=tools, tool_choice="none").status_code == 200
    for fields, param in (({"tools": tools, "tool_choice": "bogus"}, "tool_choice"),
                          ({"tool_choice": "auto"}, "tool_choice"), ({"tools": []}, "tools")):
        response = post(**fields)
        assert (response.status_code, response.json()["error"]["param"]) == (400, param), response.text


