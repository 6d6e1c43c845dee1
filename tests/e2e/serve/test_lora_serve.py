"""LoRA adapters served by a real `epd serve` (issue 28), aggregated and e-p-d,
through the official openai client: the request's `model` picks the adapter,
three adapters and the base run at once and each answer is transformers +
peft's, the base after an adapter on the same prompt gets the base's answer
(no KV shared across adapters), /v1/models lists the adapters with their
parent, an unknown name is a 404; an adapter loaded at run time (POST
/v1/load_lora_adapter) is served by every worker, and a 404 again once unloaded. In e-p-d the prompt is longer than
--max-local-prefill-tokens, so it is prefilled on the prefill worker and the
adapter travels with its KV to the decode worker."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from testkit.lora_adapters import ALL_MODULES, make_adapter, peft_greedy
from testkit.server import start_server

pytestmark = pytest.mark.slow

SERVED = "tiny-base"
NUM_TOKENS = 6
LOCAL_PREFILL = 32  # e-p-d: prompts up to this long prefill on the decode worker; ours are longer
PROMPTS = {"shared": list(range(200, 270)), "cache": list(range(600, 650))}  # 70 and 50 tokens
NAMES = [SERVED, "attn", "mlp", "all"]


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("lora")
    return {"attn": make_adapter(tiny_model, out / "attn", ("q_proj", "v_proj", "o_proj"), r=4, seed=11),
            "mlp": make_adapter(tiny_model, out / "mlp", ("gate_proj", "up_proj", "down_proj"), r=8, seed=12),
            "all": make_adapter(tiny_model, out / "all", ALL_MODULES, r=8, use_rslora=True, seed=13)}


@pytest.fixture(scope="module")
def expected(tiny_model, adapters) -> dict[tuple[str, str], list[int]]:
    """(prompt, model name) -> transformers + peft's greedy tokens."""
    cases = [(p, name) for p in PROMPTS for name in NAMES]
    tokens = peft_greedy(tiny_model, adapters, [PROMPTS[p] for p, _ in cases],
                         [None if n == SERVED else n for _, n in cases], NUM_TOKENS)
    return dict(zip(cases, tokens))


@pytest.fixture(scope="module", params=["aggregated", "e-pd", "e-p-d"])
def server(request, tiny_model, adapters, tmp_path_factory):
    mode = request.param
    extra = ["--served-model-name", SERVED, "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "2",
             "--lora-modules", f"attn={adapters['attn']}",
             json.dumps({"name": "mlp", "path": adapters["mlp"], "base_model_name": "qwen-tiny"}),
             f"all={adapters['all']}", "--allow-runtime-lora-updating"]
    if mode == "e-p-d":
        extra += ["--max-local-prefill-tokens", str(LOCAL_PREFILL)]
    srv = start_server(tiny_model, tmp_path_factory.mktemp(mode), mode, *extra)
    yield srv
    assert srv.stop() == 0, srv.log()


def _complete(client: openai.OpenAI, model: str, prompt: list[int]) -> list[int]:
    r = client.completions.create(model=model, prompt=prompt, max_tokens=NUM_TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.model == model
    return r.choices[0].model_extra["token_ids"]


def test_adapters_by_name_mixed_and_kept_apart(server, expected):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    models = {m.id: m.model_extra for m in client.models.list().data}
    assert list(models) == NAMES
    assert models["attn"]["parent"] == SERVED and models["mlp"]["parent"] == "qwen-tiny"
    assert models["all"]["root"].endswith("all") and models[SERVED]["parent"] is None

    # three adapters and the base at once (two slots: the engine runs two adapters a step)
    with ThreadPoolExecutor(len(NAMES)) as pool:
        answers = list(pool.map(lambda name: _complete(client, name, PROMPTS["shared"]), NAMES))
    assert answers == [expected["shared", name] for name in NAMES]

    # an adapter's prompt, then the base's on the same prompt: the base's answer (no KV reused)
    assert _complete(client, "all", PROMPTS["cache"]) == expected["cache", "all"]
    assert _complete(client, SERVED, PROMPTS["cache"]) == expected["cache", SERVED]
    assert _complete(client, "attn", PROMPTS["cache"]) == expected["cache", "attn"]

    with pytest.raises(openai.NotFoundError, match="The model `sql` does not exist"):
        _complete(client, "sql", PROMPTS["cache"])

    import httpx  # vLLM's lora_requests_info, one sample per engine worker, from its stats
    info = [line for line in httpx.get(server.base_url + "/metrics").text.splitlines()
            if line.startswith("epd:lora_requests_info{")]
    assert info and all('max_lora="2"' in line for line in info)


@pytest.fixture(scope="module")
def late(tiny_model, tmp_path_factory) -> tuple[str, list[int]]:
    """An adapter loaded at run time, and transformers + peft's answer with it."""
    path = make_adapter(tiny_model, tmp_path_factory.mktemp("late") / "late", ("q_proj", "down_proj"), r=8, seed=14)
    return path, peft_greedy(tiny_model, {"late": path}, [PROMPTS["shared"]], ["late"], NUM_TOKENS)[0]


def test_an_adapter_loaded_and_unloaded_at_run_time(server, late):
    import httpx

    path, tokens = late
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = httpx.post(server.base_url + "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": path})
    assert r.status_code == 200, r.text
    assert [m.id for m in client.models.list().data] == NAMES + ["late"]
    assert _complete(client, "late", PROMPTS["shared"]) == tokens
    assert httpx.post(server.base_url + "/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "late", PROMPTS["shared"])
    r = httpx.post(server.base_url + "/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]
