"""LoRA through a real `epd serve --api-servers 2` with a small KV cache (issue 28):
three adapters and the base, mixed and preempted (12 KV blocks, --max-loras 2 and
--max-cpu-loras 2 for three adapters: slots rewritten, adapters evicted from host
memory and read again), each answer transformers + peft's; an adapter loaded at run
time through one API process is served through every one (each reached on purpose
over its own unix socket), and unloaded through the other it is a 404 in both."""
from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from testkit.lora_adapters import ALL_MODULES, make_adapter, peft_greedy
from testkit.server import start_server

pytestmark = pytest.mark.slow

SERVED = "tiny-base"
NUM_TOKENS = 88
# eight distinct prompts of 40 tokens: 8 KV blocks of 16 each with the answer, so any two whose decodes
# overlap need more than the 12 blocks there are (with 24-token answers it took four at once: one CI run
# whose requests arrived spread out saw no preemption)
PROMPTS = [list(range(40 + 50 * i, 80 + 50 * i)) for i in range(8)]
MODELS = [SERVED, "attn", "mlp", "all"] * 2
API_SERVERS = (0, 1)


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("lora")
    return {"attn": make_adapter(tiny_model, out / "attn", ("q_proj", "v_proj", "o_proj"), r=4, seed=21),
            "mlp": make_adapter(tiny_model, out / "mlp", ("gate_proj", "up_proj", "down_proj"), r=8, seed=22),
            "all": make_adapter(tiny_model, out / "all", ALL_MODULES, r=8, use_rslora=True, seed=23),
            "late": make_adapter(tiny_model, out / "late", ("k_proj", "down_proj"), r=8, seed=24)}


@pytest.fixture(scope="module")
def expected(tiny_model, adapters) -> list[list[int]]:
    """transformers + peft's greedy tokens of PROMPTS[i] with MODELS[i], then PROMPTS[0] with "late"."""
    names = [None if m == SERVED else m for m in MODELS] + ["late"]
    return peft_greedy(tiny_model, adapters, [*PROMPTS, PROMPTS[0]], names, NUM_TOKENS)


@pytest.fixture(scope="module")
def server(tiny_model, adapters, tmp_path_factory):
    srv = start_server(tiny_model, tmp_path_factory.mktemp("lora-api-servers"), "aggregated",
                       "--api-servers", "2", "--served-model-name", SERVED, "--num-kv-blocks", "12",
                       "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "2", "--allow-runtime-lora-updating",
                       "--lora-modules", *(f"{name}={adapters[name]}" for name in ("attn", "mlp", "all")))
    deadline = time.monotonic() + 120
    while len(_own_sockets(srv)) < 2:  # the shared port answered: wait for both processes
        assert time.monotonic() < deadline, srv.log()
        time.sleep(0.2)
    yield srv
    assert srv.stop() == 0, srv.log()


def _own_sockets(server) -> dict[int, str]:
    """API process index -> its own unix socket, from its latest 'ready' line."""
    return {int(k): path for k, path in re.findall(r"EPD: API server (\d+) pid \d+ ready; its own socket unix:(\S+)",
                                                   server.log())}


def _http(server, index: int) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=_own_sockets(server)[index]), base_url="http://epd",
                        timeout=120)


def _client(server, index: int | None = None) -> openai.OpenAI:
    """The openai client through API process `index` (None: the shared port)."""
    if index is None:
        return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    return openai.OpenAI(base_url="http://epd/v1", api_key="unused", max_retries=0, http_client=_http(server, index))


def _complete(client: openai.OpenAI, model: str, prompt: list[int]) -> list[int]:
    r = client.completions.create(model=model, prompt=prompt, max_tokens=NUM_TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.model == model
    return r.choices[0].model_extra["token_ids"]


def test_adapters_mixed_and_preempted_equal_peft(server, expected):
    client = _client(server)
    before = server.metric_sum("epd:num_preemptions_total")
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda i: _complete(client, MODELS[i], PROMPTS[i]), range(len(PROMPTS))))
    assert answers == expected[:len(PROMPTS)]
    deadline = time.monotonic() + 10  # workers publish their counters every few hundred ms
    while server.metric_sum("epd:num_preemptions_total") <= before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.metric_sum("epd:num_preemptions_total") > before, "12 KV blocks were meant to force preemption"


def test_a_runtime_load_reaches_every_api_process(server, adapters, expected):
    with _http(server, 0) as first:
        r = first.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": adapters["late"]})
    assert r.status_code == 200, r.text
    for index in API_SERVERS:
        client = _client(server, index)
        assert [m.id for m in client.models.list().data] == [SERVED, "attn", "mlp", "all", "late"], index
        for _ in range(2):
            assert _complete(client, "late", PROMPTS[0]) == expected[-1], index
    with _http(server, 1) as second:
        assert second.post("/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
    for index in API_SERVERS:
        client = _client(server, index)
        assert "late" not in [m.id for m in client.models.list().data], index
        with pytest.raises(openai.NotFoundError):
            _complete(client, "late", PROMPTS[0])
    for _ in range(4):  # through the shared port too, whichever process takes the connection
        with pytest.raises(openai.NotFoundError):
            _complete(_client(server), "late", PROMPTS[0])
