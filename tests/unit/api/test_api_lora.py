"""The API's side of --lora-modules (issue 28), in front of the fake orchestrator:
a request's `model` picks the adapter it carries to the workers, answers are
labelled with that name, /v1/models lists the adapters with their parent, an
unknown name is vLLM's 404."""
from __future__ import annotations

import httpx
import openai
import pytest
from testkit.fake_api import API_KEY, AUTH, MODEL, FakeOrchestrator, serve_app, user

from epd.lora_modules import LoRAModule, lora_requests, parse_lora_modules
from epd.transport.wire.lora_request import LoRARequest

MODULES = (LoRAModule("sql", "/adapters/sql"), LoRAModule("chat", "/adapters/chat", "qwen-base"))


@pytest.fixture(scope="module")
def served():
    yield from serve_app(FakeOrchestrator(), lora_modules=MODULES)


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key=API_KEY, max_retries=0)


def test_the_model_picks_the_adapter_the_request_carries(served, client):
    _, fake = served
    chat = client.chat.completions.create(model="sql", messages=user("hi"), max_tokens=2)
    assert chat.model == "sql" and fake.requests[-1].lora == LoRARequest("sql", 1, "/adapters/sql")
    done = client.completions.create(model="chat", prompt="hi", max_tokens=2)
    assert done.model == "chat" and fake.requests[-1].lora == LoRARequest("chat", 2, "/adapters/chat")
    base = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert base.model == MODEL and fake.requests[-1].lora is None


def test_an_unknown_model_is_a_404_model_not_found(served, client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="sqlx", prompt="hi", max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    r = httpx.post(f"{served[0]}/tokenize", json={"model": "sqlx", "prompt": "hi"}, headers=AUTH)
    assert r.status_code == 404
    assert httpx.post(f"{served[0]}/tokenize", json={"model": "chat", "prompt": "hi"}, headers=AUTH).status_code == 200


def test_models_lists_the_adapters_with_their_parent(client):
    cards = {m.id: m.model_extra for m in client.models.list().data}
    assert list(cards) == [MODEL, "sql", "chat"]
    assert cards["sql"]["parent"] == MODEL and cards["chat"]["parent"] == "qwen-base"
    assert cards["sql"]["root"] == "/adapters/sql" and cards[MODEL]["parent"] is None
    assert client.models.retrieve("chat").model_extra["parent"] == "qwen-base"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_lora_modules_in_both_of_vllms_forms():
    modules = parse_lora_modules(["sql=/a/sql", '{"name": "chat", "path": "/a/chat", "base_model_name": "q"}'])
    assert modules == (LoRAModule("sql", "/a/sql"), LoRAModule("chat", "/a/chat", "q"))
    assert lora_requests(modules)["chat"] == LoRARequest("chat", 2, "/a/chat")


@pytest.mark.parametrize("values, message", [
    (["sql"], "takes name=path or a JSON object"),
    (["=/a"], "takes name=path"),
    (['{"name": "x"}'], "expected"),
    (['{"name": "x", "path": "/a", "rank": 8}'], r"unknown keys \['rank'\]"),
    (['{"name": '], "not valid JSON"),
    (["a=/x", "a=/y"], "a name given twice"),
])
def test_bad_lora_modules_are_refused_naming_the_flag(values, message):
    with pytest.raises(ValueError, match=message):
        parse_lora_modules(values)
