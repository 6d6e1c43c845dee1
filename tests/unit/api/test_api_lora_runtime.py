"""Runtime LoRA updating (issue 28), vLLM's POST /v1/load_lora_adapter and
/v1/unload_lora_adapter behind --allow-runtime-lora-updating, in front of the
fake orchestrator: a loaded adapter is listed and served by name and announced
to the workers, an unloaded one is a 404 again; vLLM's refusals and bodies."""
from __future__ import annotations

import httpx
import openai
import pytest
from testkit.fake_api import API_KEY, AUTH, MODEL, FakeOrchestrator, serve_app

from epd.lora_modules import LoRAModule
from epd.transport.wire.lora_request import LoRARequest


@pytest.fixture()
def served():
    yield from serve_app(FakeOrchestrator(), lora_modules=(LoRAModule("sql", "/adapters/sql"),),
                         allow_runtime_lora_updating=True)


def _post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, headers=AUTH)


def test_load_serve_unload(served, tmp_path):
    base, fake = served
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)
    (tmp_path / "chat").mkdir()
    r = _post(base, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": str(tmp_path / "chat")})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'chat' added successfully."
    chat = LoRARequest("chat", 2, str(tmp_path / "chat"))  # ids count on from --lora-modules'
    assert fake.lora_updates == [(chat, True)]
    assert [m.id for m in client.models.list().data] == [MODEL, "sql", "chat"]
    assert client.models.retrieve("chat").model_extra["parent"] == MODEL
    done = client.completions.create(model="chat", prompt="hi", max_tokens=2)
    assert done.model == "chat" and fake.requests[-1].lora == chat

    r = _post(base, "/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'chat' removed successfully."
    assert fake.lora_updates[-1] == (chat, False)
    assert [m.id for m in client.models.list().data] == [MODEL, "sql"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="chat", prompt="hi", max_tokens=2)
    # a --lora-modules adapter unloads too, by its id
    assert _post(base, "/v1/unload_lora_adapter", {"lora_int_id": 1}).status_code == 200
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_vllms_refusals(served, tmp_path):
    base, fake = served
    (tmp_path / "bad").mkdir()
    cases = [
        ({"lora_name": "x"}, 400, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided."),
        ({"lora_name": "sql", "lora_path": str(tmp_path)}, 400, "InvalidUserInput", "has already been loaded"),
        ({"lora_name": "x", "lora_path": str(tmp_path / "none")}, 404, "NotFoundError", "No adapter found"),
        ({"lora_name": "x", "lora_path": str(tmp_path / "bad")}, 400, "BadRequestError", "above --max-lora-rank"),
    ]
    for body, status, kind, message in cases:
        r = _post(base, "/v1/load_lora_adapter", body)
        assert (r.status_code, r.json()["error"]["type"]) == (status, kind), body
        assert message in r.json()["error"]["message"]
    r = _post(base, "/v1/unload_lora_adapter", {"lora_name": "nope"})
    assert r.status_code == 404 and r.json()["error"]["message"] == "The lora adapter 'nope' cannot be found."
    assert _post(base, "/v1/unload_lora_adapter", {}).status_code == 400
    assert fake.lora_updates == [] and httpx.get(f"{base}/v1/models/x", headers=AUTH).status_code == 404


def test_without_the_flag_the_routes_do_not_exist(tmp_path):
    for base, fake in serve_app(FakeOrchestrator()):
        r = _post(base, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})
        assert r.status_code == 404 and fake.lora_updates == []


def test_api_processes_sharing_a_registry_file_see_each_others_updates(tmp_path):
    """--api-servers N: each process's app reads the adapters from one shared file, so a load
    through one is served by the others, an unload through another is a 404 everywhere, and
    a process started later (a restart) finds the runtime loads; ids are never handed out twice."""
    import contextlib

    (tmp_path / "chat").mkdir()
    (tmp_path / "code").mkdir()
    shared = dict(lora_modules=(LoRAModule("sql", "/adapters/sql"),), allow_runtime_lora_updating=True,
                  lora_registry_path=str(tmp_path / "loras.json"))
    with contextlib.ExitStack() as stack:
        apps = []
        for _ in range(2):
            served = serve_app(FakeOrchestrator(), **shared)
            stack.callback(next, served, None)  # on past its yield: the server stops
            apps.append(next(served))
        (first, fake_first), (second, fake_second) = apps
        clients = [openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0) for base, _ in apps]
        for name, base in (("chat", first), ("code", second)):
            r = _post(base, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(tmp_path / name)})
            assert r.status_code == 200, r.text
        r = _post(first, "/v1/load_lora_adapter", {"lora_name": "code", "lora_path": str(tmp_path / "code")})
        assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
        for client, fake in zip(clients, (fake_first, fake_second)):
            assert [m.id for m in client.models.list().data] == [MODEL, "sql", "chat", "code"]
            assert client.completions.create(model="chat", prompt="hi", max_tokens=2).model == "chat"
            assert fake.requests[-1].lora == LoRARequest("chat", 2, str(tmp_path / "chat"))
        assert fake_second.lora_updates == [(LoRARequest("code", 3, str(tmp_path / "code")), True)]

        later = serve_app(FakeOrchestrator(), **shared)  # a restarted API process
        stack.callback(next, later, None)
        third, _ = next(later)
        assert _post(third, "/v1/unload_lora_adapter", {"lora_name": "chat"}).status_code == 200
        for client in clients:
            assert [m.id for m in client.models.list().data] == [MODEL, "sql", "code"]
            with pytest.raises(openai.NotFoundError):
                client.completions.create(model="chat", prompt="hi", max_tokens=2)
        r = _post(second, "/v1/unload_lora_adapter", {"lora_name": "chat"})
        assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]
