"""LoRA adapters served by a real `epd serve` (issue 28), aggregated and e-p-d,
through the official openai client: the request's `model` picks the adapter,
three adapters and the base run at once and each answer is transformers +
peft's, the base after an adapter on the same prompt gets the base's answer
(no KV shared across adapters), /v1/models lists the adapters with their
parent, an unknown name is a 404; an adapter loaded at run time (POST
/v1/load_lora_adapter) is served by every worker, and a 404 again once unloaded. In e-p-d the prompt is longer than
--max-local-prefill-tokens, so it is prefilled on the prefill worker and the
adapter travels with its KV to the decode worker. Issue 44 on the same servers:
an adapter deleted and pushed out of host memory fails its request (a 400
naming it), never a worker; one unloaded mid-stream keeps its weights for
that stream; oversized headers and sparse files are refused at load, a
missing directory and an empty one answered alike; idle workers hold at most
--max-cpu-loras adapters after many runtime loads."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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


# -- issue 44: adapter faults fail the request, never a worker ------------------------------------

def _load(server, name: str, path) -> None:
    import httpx

    r = httpx.post(server.base_url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
    assert r.status_code == 200, r.text


def _unload(server, name: str) -> int:
    import httpx

    return httpx.post(server.base_url + "/v1/unload_lora_adapter", json={"lora_name": name}).status_code


def test_a_deleted_adapter_fails_its_request_not_the_worker(server, late, tmp_path):
    """Loaded, its directory deleted, pushed out of host memory (--max-cpu-loras 2) by two
    others, then requested while a base stream runs: a 400 naming it, no worker restarted."""
    import shutil

    import httpx

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    gone = shutil.copytree(late[0], tmp_path / "gone")
    _load(server, "gone", gone)
    assert _complete(client, "gone", PROMPTS["shared"]) == late[1]
    shutil.rmtree(gone)
    _complete(client, "attn", PROMPTS["cache"])
    _complete(client, "mlp", PROMPTS["cache"])
    stream = client.completions.create(model=SERVED, prompt=PROMPTS["cache"], max_tokens=32, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))  # the other user's stream runs while the deleted adapter is asked for
    with pytest.raises(openai.BadRequestError, match="LoRA adapter 'gone'"):
        _complete(client, "gone", PROMPTS["shared"])
    rest = list(stream)
    assert [*first.choices, *(c for e in rest for c in e.choices)][-1].finish_reason == "length"
    assert server.metric_sum("epd:worker_restarts_total") == 0, server.log()[-3000:]
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert _unload(server, "gone") == 200


def test_an_adapter_unloaded_mid_stream_keeps_its_weights_until_the_stream_ends(server, late, tmp_path):
    """Its files deleted, then unloaded, while its stream runs: the stream ends with the
    adapter's tokens (no step reads the deleted files, no other stream fails)."""
    import shutil

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    brief = shutil.copytree(late[0], tmp_path / "brief")
    _load(server, "brief", brief)
    body = dict(model="brief", prompt=PROMPTS["shared"], max_tokens=300, temperature=0,
                extra_body={"ignore_eos": True})
    expected_text = client.completions.create(**body).choices[0].text
    stream = iter(client.completions.create(**body, stream=True))
    events = [next(stream)]
    shutil.rmtree(brief)
    assert _unload(server, "brief") == 200
    assert events[0].choices[0].finish_reason is None  # it runs on after the unload
    events += list(stream)
    assert events[-1].choices[0].finish_reason == "length"
    assert "".join(c.text for e in events for c in e.choices) == expected_text
    assert server.metric_sum("epd:worker_restarts_total") == 0


def test_adapter_files_bounded_before_any_worker_reads_them(server, late, tmp_path):
    """A header above the bound, a sparse weights file (a 1 GiB hole in a tensor nothing
    reads) are 400s naming why; a missing directory and one without adapter_config.json get
    one answer (vLLM's 404), so a key holder cannot map the server's directories."""
    import httpx

    from bench.dev.reliability_probe_lora import write_big_header, write_sparse
    from epd.transport.weights.lora_files import MAX_HEADER_BYTES

    def load(name: str, path) -> httpx.Response:
        return httpx.post(server.base_url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                          timeout=60)

    big = write_big_header(Path(late[0]), tmp_path / "big", 20_000)
    assert (big / "adapter_model.safetensors").stat().st_size > MAX_HEADER_BYTES
    r = load("big", big)
    assert r.status_code == 400 and f"above the {MAX_HEADER_BYTES}" in r.json()["error"]["message"]
    r = load("sparse", write_sparse(Path(late[0]), tmp_path / "sparse", 1 << 30))
    assert r.status_code == 400 and "more than a rank-8 adapter of this model can" in r.json()["error"]["message"]
    (tmp_path / "empty").mkdir()
    answers = []
    for name, path in (("missing", tmp_path / "no-such-dir"), ("empty", tmp_path / "empty")):
        r = load(name, path)
        error = r.json()["error"]
        answers.append((r.status_code, error["type"], error["message"].replace(str(path), "P").replace(name, "N")))
    assert answers[0] == answers[1] == (404, "NotFoundError", "Loading lora N failed: No adapter found for P")
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_idle_workers_keep_host_memory_within_max_cpu_loras(server, late):
    """Runtime loads read each adapter ahead in every engine worker; with no request, no step
    runs, yet each holds at most --max-cpu-loras (2) of them (epd:lora_cpu_adapters)."""
    names = [f"many-{i}" for i in range(12)]
    for name in names:
        _load(server, name, late[0])
    server.settled_sum("epd:lora_cpu_adapters")
    held = {k: v for k, v in server.metrics().items() if k.startswith("epd:lora_cpu_adapters{")}
    assert held and max(held.values()) <= 2, held
    assert [_unload(server, name) for name in names] == [200] * len(names)
