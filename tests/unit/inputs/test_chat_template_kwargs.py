"""vLLM's chat_template_kwargs: variables the chat template reads (Qwen3's
`enable_thinking`, ...), through the prompt builder, the offline LLM and the
chat request; the template arguments EPD sets itself cannot be set this way."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from epd.api.protocol import parse_chat_request
from epd.inputs.prompt import PromptBuilder
from epd.requests import RequestError
from epd.families.qwen_vl.prompt_format import QWEN_VL_FORMAT

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% if thinking is defined and not thinking %}"
            "<no-think>{% endif %}{% endif %}")
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def builder(tiny_model):
    return PromptBuilder(AutoTokenizer.from_pretrained(tiny_model), None, 0, chat_template=TEMPLATE,
                         prompt_format=QWEN_VL_FORMAT)


def test_the_kwargs_reach_the_template(builder):
    assert builder.render(MESSAGES) == "<user>hi<assistant>"
    assert builder.render(MESSAGES, template_kwargs={"thinking": False}) == "<user>hi<assistant><no-think>"
    built = builder.build(MESSAGES, [], template_kwargs={"thinking": False})
    assert builder.tokenizer.decode(built.token_ids) == "<user>hi<assistant><no-think>"


def test_a_chat_request_carries_them_and_refuses_reserved_names():
    body = {"model": "m", "messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}
    assert parse_chat_request(body).to_generate_request("r").chat_template_kwargs == {"enable_thinking": False}
    assert parse_chat_request({**body, "chat_template_kwargs": {}}).to_generate_request("r").chat_template_kwargs \
        is None
    for name in ("add_generation_prompt", "tools", "chat_template"):
        with pytest.raises(RequestError) as err:
            parse_chat_request({**body, "chat_template_kwargs": {name: 1}}).to_generate_request("r")
        assert err.value.param == "chat_template_kwargs" and name in str(err.value)
