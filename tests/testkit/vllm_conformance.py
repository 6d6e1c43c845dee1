"""What tests/e2e/api/test_vllm_conformance*.py share: vLLM's tests' requests, made
with the official `openai` client against a served tiny checkpoint."""
from __future__ import annotations

import openai
import pytest

from testkit.mode_servers import SERVED_MODEL

MODEL = SERVED_MODEL
PROMPT = "Hello, my name is"
MESSAGES = [{"role": "system", "content": "you are a helpful assistant"}, {"role": "user", "content": "what is 1+1?"}]
NO_EOS = {"ignore_eos": True}  # the random checkpoint may end early; vLLM's tests count on `length`


@pytest.fixture(scope="module")
def client(mode_server) -> openai.OpenAI:
    """The official client on the module's server (a fixture both conformance modules import)."""
    return openai_client(mode_server)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def complete(client, prompt=PROMPT, max_tokens=5, extra=None, **kwargs):
    kwargs.setdefault("temperature", 0)
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                     extra_body={**NO_EOS, **(extra or {})}, **kwargs)


def chat(client, messages=MESSAGES, max_tokens=5, extra=None, **kwargs):
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=max_tokens,
                                          extra_body={**NO_EOS, **(extra or {})}, **kwargs)


def chat_prompt_ids(tokenizer, messages, **kwargs) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def refused(call, status=400) -> openai.APIStatusError:
    """The error `call` raised: an OpenAI error body with `status`."""
    with pytest.raises(openai.APIStatusError) as info:
        call()
    assert info.value.status_code == status, info.value
    body = info.value.body
    assert isinstance(body, dict) and isinstance(body.get("message"), str) and "type" in body, body
    return info.value
