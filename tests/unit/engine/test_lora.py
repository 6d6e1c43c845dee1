"""Multi-LoRA in the engine (issue 28): adapters made with peft on the tiny
checkpoint give transformers + peft's greedy tokens, mixed in one batch with
the base model; slots and host memory evict; the prefix cache keeps adapters
apart; bad adapters are refused naming the field."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from testkit.lora_adapters import ALL_MODULES, make_adapter, peft_greedy

from epd.transport.wire.lora_request import LoRARequest
from epd.transport.wire.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# token ids of the tiny checkpoint's vocabulary; one of 40 tokens covers two full KV blocks
PROMPTS = [list(range(10, 17)), list(range(100, 140)), [5, 900, 33, 7, 512, 64, 3, 3, 8], list(range(300, 321))]
NAMES = [None, "attn", "mlp", "all"]


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("lora")
    return {"attn": make_adapter(tiny_model, out / "attn", ("q_proj", "k_proj", "v_proj", "o_proj"), r=4, seed=1),
            "mlp": make_adapter(tiny_model, out / "mlp", ("gate_proj", "up_proj", "down_proj"), r=8, seed=2,
                                use_rslora=True),
            "all": make_adapter(tiny_model, out / "all", ALL_MODULES, r=16, lora_alpha=8, seed=3)}


@pytest.fixture(scope="module")
def loras(adapters) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i, path) for i, (name, path) in enumerate(adapters.items(), start=1)}


@pytest.fixture(scope="module")
def expected(tiny_model, adapters) -> dict[tuple[int, str | None], list[int]]:
    """(prompt index, adapter) -> transformers + peft's greedy tokens."""
    cases = [(i, name) for i in range(len(PROMPTS)) for name in NAMES]
    tokens = peft_greedy(tiny_model, adapters, [PROMPTS[i] for i, _ in cases], [n for _, n in cases], 8)
    return dict(zip(cases, tokens))


def _llm(tiny_model, **settings):
    from epd import LLM

    return LLM(tiny_model, **{"dtype": "float32", "device": "cpu", "num_kv_blocks": 64, **settings})


def test_the_adapters_change_the_answers(expected):
    for name in NAMES[1:]:
        assert any(expected[i, name] != expected[i, None] for i in range(len(PROMPTS))), name


ON_GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs a CUDA GPU")])


@pytest.mark.parametrize("device", ["cpu", ON_GPU])
def test_three_adapters_and_the_base_in_one_batch_match_peft(tiny_model, loras, expected, device):
    # two slots and two adapters in host memory for three adapters: steps run at most two
    # adapters, slots are rewritten and adapters read again; a KV budget that forces preemption
    # (recomputed with the adapter) and a token budget that chunks the prompts
    llm = _llm(tiny_model, enable_lora=True, max_loras=2, max_cpu_loras=2, device=device,
               num_kv_blocks=14, max_num_batched_tokens=24)
    cases = [(i, name) for i in range(len(PROMPTS)) for name in NAMES]
    outs = llm.generate([PROMPTS[i] for i, _ in cases], GREEDY,
                        lora_request=[None if n is None else loras[n] for _, n in cases])
    assert {case: o.outputs[0].token_ids for case, o in zip(cases, outs)} == expected
    # three adapters through two slots: a slot was written over; two in host memory: read again
    assert llm.engine.lora.num_slot_loads >= 3 and llm.engine.lora.num_loads > 3
    assert llm.stats()["num_preemptions"] > 0, "the KV budget was meant to force preemption"
    assert llm.engine.num_free_blocks() == llm.engine.num_blocks


def test_one_adapter_for_every_prompt(tiny_model, loras, expected):
    llm = _llm(tiny_model, enable_lora=True, max_lora_rank=16)
    outs = llm.generate(PROMPTS, GREEDY, lora_request=loras["all"])
    assert [o.outputs[0].token_ids for o in outs] == [expected[i, "all"] for i in range(len(PROMPTS))]


def test_the_prefix_cache_keeps_adapters_apart(tiny_model, loras, expected):
    llm = _llm(tiny_model, enable_lora=True)
    prompt = PROMPTS[1]  # two full blocks: cached after the first request

    def run(lora):
        before = llm.stats()["prefix_cache_hits"]
        tokens = llm.generate([prompt], GREEDY, lora_request=lora)[0].outputs[0].token_ids
        return tokens, llm.stats()["prefix_cache_hits"] - before

    assert run(loras["attn"]) == (expected[1, "attn"], 0)
    assert run(None) == (expected[1, None], 0)  # the adapter's blocks are not the base's
    assert run(loras["mlp"]) == (expected[1, "mlp"], 0)
    tokens, hits = run(None)
    assert tokens == expected[1, None] and hits > 0  # the base's own blocks are
    tokens, hits = run(loras["attn"])
    assert tokens == expected[1, "attn"] and hits > 0


def test_an_adapter_without_enable_lora_is_refused(tiny_model, loras):
    llm = _llm(tiny_model)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=loras["attn"])


def test_a_rank_above_max_lora_rank_is_refused_before_any_work(tiny_model, loras):
    llm = _llm(tiny_model, enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError, match=r"'all' .*: r = 16 is above --max-lora-rank 8"):
        llm.generate(PROMPTS[:2], GREEDY, lora_request=[None, loras["all"]])
    assert not llm.engine.has_unfinished()


# -- the checks, on the files (torch-free) -----------------------------------------------------

@pytest.fixture(scope="module")
def shapes(tiny_model):
    from transformers import AutoConfig

    from epd.engine.lora.adapter import ProjectionShapes

    return ProjectionShapes.from_hf(AutoConfig.from_pretrained(tiny_model))


def test_the_shapes_from_the_config_are_the_engines(tiny_model, shapes):
    from transformers import AutoConfig

    from epd.engine.lora.adapter import ProjectionShapes
    from epd.families.qwen_vl.text_configs import text_config

    hf_config = AutoConfig.from_pretrained(tiny_model)
    assert shapes == ProjectionShapes.of(text_config(hf_config))


def _copy(adapter: str, tmp_path, config_changes=None) -> str:
    out = tmp_path / "adapter"
    shutil.copytree(adapter, out)
    if config_changes:
        cfg = json.loads((out / "adapter_config.json").read_text())
        (out / "adapter_config.json").write_text(json.dumps({**cfg, **config_changes}))
    return str(out)


@pytest.mark.parametrize("changes, message", [
    ({"target_modules": ["q_proj", "lm_head"]}, r"target_modules \['lm_head'\] are not projections"),
    ({"r": 32}, r"r = 32 is above --max-lora-rank 16"),
    ({"use_dora": True}, "use_dora is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"peft_type": "IA3"}, "peft_type 'IA3' is not LORA"),
    ({"r": 8}, r"tensor '.*' has shape \[\d+, \d+\], expected \[\d+, \d+\] \(r = 8"),  # the config lies
])
def test_a_bad_adapter_config_is_refused_naming_the_field(adapters, shapes, tmp_path, changes, message):
    from epd.engine.lora.adapter import LoRAAdapterError, read_adapter

    path = _copy(adapters["all"], tmp_path, changes)
    with pytest.raises(LoRAAdapterError, match=message):
        read_adapter("bad", path, shapes, max_lora_rank=16)


def _rewrite_weights(path: str, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(f"{path}/adapter_model.safetensors")
    save_file(change(tensors), f"{path}/adapter_model.safetensors")


def test_an_adapter_of_another_base_is_refused_naming_the_tensor(adapters, shapes, tmp_path):
    import torch

    from epd.engine.lora.adapter import LoRAAdapterError, read_adapter

    path = _copy(adapters["attn"], tmp_path)
    key = next(k for k in _keys(path) if k.endswith("q_proj.lora_A.weight"))
    _rewrite_weights(path, lambda t: {**t, key: torch.zeros(4, 128)})  # hidden 128: another model
    with pytest.raises(LoRAAdapterError, match=r"has shape \[4, 128\], expected \[4, 64\].*another base"):
        read_adapter("other", path, shapes, max_lora_rank=16)


def test_weights_of_a_module_the_model_lacks_are_refused(adapters, shapes, tmp_path):
    import torch

    from epd.engine.lora.adapter import LoRAAdapterError, read_adapter

    path = _copy(adapters["attn"], tmp_path)
    _rewrite_weights(path, lambda t: {**t, "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)})
    with pytest.raises(LoRAAdapterError, match="lm_head.lora_A.weight' is not a LoRA weight"):
        read_adapter("head", path, shapes, max_lora_rank=16)


def test_a_directory_without_an_adapter_is_refused(shapes, tmp_path):
    from epd.engine.lora.adapter import LoRAAdapterError, read_adapter

    with pytest.raises(LoRAAdapterError, match="no adapter_config.json"):
        read_adapter("none", str(tmp_path), shapes, max_lora_rank=16)


def _keys(path: str):
    from safetensors import safe_open

    with safe_open(f"{path}/adapter_model.safetensors", framework="pt") as f:
        return list(f.keys())


# -- adapters read off the step loop ----------------------------------------------------------

def test_running_requests_go_on_while_an_adapter_is_read(tiny_model, loras, expected):
    import threading

    from epd.engine.request import Request
    from epd.transport.wire.wire_values import LoRAState

    core = _llm(tiny_model, enable_lora=True).engine
    gate = threading.Event()
    core.lora._loader.submit(gate.wait)  # the loader thread busy: the adapter's read waits behind it (a slow disk)
    base = Request("base", list(PROMPTS[0]), GREEDY)
    tuned = Request("tuned", list(PROMPTS[1]), GREEDY, lora_request=loras["attn"])
    core.add_request(base)
    core.add_request(tuned)  # returns at once: the read is queued, not done here
    for _ in range(20):
        if base.is_finished:
            break
        core.step()
    try:
        # the base request ran to the end while the adapter was in flight; the tuned one waited outside
        assert base.output_token_ids == expected[0, None]
        assert tuned.output_token_ids == [] and core.num_waiting == 0 and core.has_unfinished()
        assert core.lora.num_loads == 0 and not core.lora.is_loaded(loras["attn"].key)
        assert core.lora_state() == LoRAState((), ("attn",), (), 1)  # its stats: lora_requests_info
    finally:
        gate.set()
    for _ in range(200):
        if tuned.is_finished:
            break
        core.step()
    assert tuned.output_token_ids == expected[1, "attn"] and core.lora.num_loads == 1
    assert core.lora_state() == LoRAState((), (), ("attn",), 1, 1)  # resident (routers) and in host memory


def test_a_bad_adapter_fails_its_request_at_admission_not_the_step(tiny_model, adapters, expected, tmp_path):
    from epd.engine.request import Request
    from epd.transport.wire.lora_request import LoRARequest

    bad = tmp_path / "bad"
    shutil.copytree(adapters["attn"], bad)
    (bad / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")  # torn file
    core = _llm(tiny_model, enable_lora=True).engine
    base = Request("base", list(PROMPTS[0]), GREEDY)
    core.add_request(base)
    core.add_request(Request("bad", list(PROMPTS[1]), GREEDY, lora_request=LoRARequest("bad", 9, str(bad))))
    failed: dict[str, str] = {}
    for _ in range(200):
        if base.is_finished and not core.has_unfinished():
            break
        failed.update(core.step().failed)
    assert list(failed) == ["bad"] and "a padded, sparse or truncated file" in failed["bad"]
    assert base.output_token_ids == expected[0, None]


def test_an_evicted_adapter_is_read_again_off_the_step_loop(tiny_model, loras, expected):
    import threading

    from epd.engine.request import Request

    core = _llm(tiny_model, enable_lora=True, max_loras=1, max_cpu_loras=1).engine
    core.load_lora(loras["attn"])
    core.load_lora(loras["mlp"])  # two read, room for one: the first step evicts "mlp"
    base = Request("base", list(PROMPTS[0]), GREEDY)
    attn = Request("attn", list(PROMPTS[1]), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                   lora_request=loras["attn"])
    mlp = Request("mlp", list(PROMPTS[2]), GREEDY, lora_request=loras["mlp"])
    for request in (base, attn, mlp):
        core.add_request(request)
    # base and attn run; mlp's adapter leaves host memory (room for one: attn's came first) and mlp waits
    core.step()
    assert not core.lora.is_loaded(loras["mlp"].key) and core.lora.is_loaded(loras["attn"].key)
    gate = threading.Event()
    deadline = threading.Timer(60, gate.set)  # a read done in the step would hold it until then
    deadline.start()
    core.lora._loader.submit(gate.wait)  # the loader thread busy: mlp's second read waits (a slow disk)
    try:
        for _ in range(40):
            if base.is_finished:
                break
            core.step()
        # once attn finished, mlp's adapter was asked for again; base ran on to its end meanwhile
        assert attn.output_token_ids == expected[1, "attn"][:2] and base.output_token_ids == expected[0, None]
        assert mlp.output_token_ids == [] and core.num_waiting == 1 and gate.is_set() is False
        assert core.lora.num_loads == 2 and not core.lora.is_loaded(loras["mlp"].key)
    finally:
        gate.set()
        deadline.cancel()
    for _ in range(200):
        if mlp.is_finished:
            break
        core.step()
    assert mlp.output_token_ids == expected[2, "mlp"] and core.lora.num_loads == 3
    assert not core.lora.is_loaded(loras["attn"].key)  # host memory back to --max-cpu-loras


def test_an_adapter_retrained_in_place_is_not_served_its_old_kv(tiny_model, adapters, expected, tmp_path):
    # one adapter directory, rewritten between two reads (same name, same path, new weights):
    # the KV computed with the old weights is no prefix hit for the new ones, and the new ones'
    # own blocks are (the key is the digest of the files the worker read, not the name and path)
    path = tmp_path / "retrained"
    shutil.copytree(adapters["attn"], path)
    retrained = LoRARequest("retrained", 7, str(path))
    llm = _llm(tiny_model, enable_lora=True, max_loras=1, max_cpu_loras=1)
    prompt = PROMPTS[1]  # two full blocks: cached after the first request

    def run(lora):
        before = llm.stats()["prefix_cache_hits"]
        tokens = llm.generate([prompt], GREEDY, lora_request=lora)[0].outputs[0].token_ids
        return tokens, llm.stats()["prefix_cache_hits"] - before

    assert run(retrained) == (expected[1, "attn"], 0)
    llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("all", 3, adapters["all"]))  # evicts it
    for file in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(f"{adapters['mlp']}/{file}", path / file)
    assert run(retrained) == (expected[1, "mlp"], 0)  # read again: the new weights, none of the old KV
    tokens, hits = run(retrained)
    assert tokens == expected[1, "mlp"] and hits > 0
    assert llm.engine.lora.num_loads == 3


def test_an_evicted_adapter_whose_files_are_gone_fails_its_request_not_the_step(tiny_model, adapters, loras,
                                                                              expected, tmp_path):
    # issue 44: read, evicted (room for one), its directory deleted, then asked for again:
    # its waiting request fails with the adapter's name; the others run to their end
    from epd.engine.request import Request

    doomed = LoRARequest("doomed", 8, str(shutil.copytree(adapters["mlp"], tmp_path / "doomed")))
    core = _llm(tiny_model, enable_lora=True, max_loras=1, max_cpu_loras=1).engine
    core.load_lora(loras["attn"])
    core.load_lora(doomed)
    base = Request("base", list(PROMPTS[0]), GREEDY)
    attn = Request("attn", list(PROMPTS[1]), GREEDY, lora_request=loras["attn"])
    late = Request("late", list(PROMPTS[2]), GREEDY, lora_request=doomed)
    for request in (base, attn, late):
        core.add_request(request)
    core.step()  # base and attn run; doomed's adapter leaves host memory and its request waits
    assert not core.lora.is_loaded(doomed.key)
    shutil.rmtree(doomed.lora_path)
    failed: dict[str, str] = {}
    for _ in range(200):
        if not core.has_unfinished():
            break
        failed.update(core.step().failed)
    assert list(failed) == ["late"] and "LoRA adapter 'doomed'" in failed["late"]
    assert base.output_token_ids == expected[0, None] and attn.output_token_ids == expected[1, "attn"]
