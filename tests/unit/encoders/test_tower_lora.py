"""LoRA on the vision tower (issue 28, --enable-tower-lora), offline: adapters made
with peft on the tiny checkpoint's tower (and language model) change the image
answers, and equal transformers + peft's greedy tokens and logprobs, mixed in one
call with the base and a language-only adapter; without the flag the tower weights
are ignored with a warning (vLLM's behaviour); the tower's shapes from the config
are the built tower's; bad tower weights are refused naming the tensor."""
from __future__ import annotations

import logging
import shutil

import pytest
import torch
from testkit.lora_adapters import TOWER_MODULES, make_adapter, peft_image_greedy
from testkit.media import CHATS

from epd.transport.wire.lora_request import LoRARequest
from epd.transport.wire.sampling import SamplingParams

NUM_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)
MESSAGES, IMAGES = CHATS["one_image"]
NAMES = [None, "tower", "vit", "lang"]


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("tower-lora")
    return {  # tower and language model; the tower only; the language model only
        "tower": make_adapter(tiny_model, out / "tower", TOWER_MODULES + ("q_proj", "v_proj"), r=8, seed=21),
        "vit": make_adapter(tiny_model, out / "vit", ("qkv", "linear_fc2"), r=4, seed=22, use_rslora=True),
        "lang": make_adapter(tiny_model, out / "lang", ("q_proj", "v_proj"), r=4, seed=23)}


@pytest.fixture(scope="module")
def loras(adapters) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i, path) for i, (name, path) in enumerate(adapters.items(), start=1)}


@pytest.fixture(scope="module")
def expected(tiny_model, adapters) -> dict[str | None, tuple[list[int], list[float]]]:
    """adapter (None: the base) -> transformers + peft's greedy tokens and their logprobs."""
    return dict(zip(NAMES, peft_image_greedy(tiny_model, adapters, MESSAGES, IMAGES, NAMES, NUM_TOKENS)))


def _llm(tiny_model, **settings):
    from epd import LLM

    return LLM(tiny_model, **{"dtype": "float32", "device": "cpu", "num_kv_blocks": 64, "enable_lora": True,
                              **settings})


def test_a_tower_adapter_changes_the_image_answers(expected):
    assert expected["vit"][0] != expected[None][0]  # the tower alone
    assert expected["tower"][0] != expected["lang"][0]


ON_GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs a CUDA GPU")])


@pytest.mark.parametrize("device", ["cpu", ON_GPU])
def test_tower_adapters_match_transformers_and_peft(tiny_model, loras, expected, device):
    # two slots on each side for three adapters: the tower's slot is rewritten, "lang" never reaches it
    llm = _llm(tiny_model, enable_tower_lora=True, max_loras=2, max_cpu_loras=2, device=device)
    outs = llm.chat([MESSAGES] * len(NAMES), GREEDY, lora_request=[None if n is None else loras[n] for n in NAMES])
    tolerance = 1e-3 if device == "cpu" else 2e-2  # cuDNN's convolution may take TF32 on a GPU
    for name, out in zip(NAMES, outs):
        tokens, logprobs = expected[name]
        assert out.outputs[0].token_ids == tokens, name
        assert [lp.logprob for lp in out.outputs[0].logprobs] == pytest.approx(logprobs, abs=tolerance), name
    assert llm.encoder.lora.num_loads == 2  # "tower" and "vit": a language-only adapter costs the tower nothing
    assert sorted(name for name, _ in llm.encoder.lora.resident) == ["tower", "vit"]


def test_a_tower_only_adapter_takes_no_language_model_slot(tiny_model, loras):
    # one slot on the engine: "vit" (tower weights only) runs beside "lang" in one step, on the
    # base language model (a text prompt: the base's answer and the base's KV blocks), and is
    # never written into the slot, so it evicts nothing and counts against nothing there
    from epd.engine.request import Request
    from epd.transport.wire.wire_values import LoRAState

    core = _llm(tiny_model, enable_tower_lora=True, max_loras=1, max_cpu_loras=2).engine
    prompt, params = list(range(100, 140)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    core.load_lora(loras["vit"])
    core.load_lora(loras["lang"])
    base = Request("base", list(prompt), params)
    core.add_request(base)
    while core.has_unfinished():
        core.step()
    lang = Request("lang", list(range(300, 321)), params, lora_request=loras["lang"])
    vit = Request("vit", list(prompt), params, lora_request=loras["vit"])
    core.add_request(lang)
    core.add_request(vit)
    core.step()
    assert core.num_running == 2 and core.num_waiting == 0  # the one slot is lang's alone
    assert core.lora_state() == LoRAState(("lang", "vit"), (), ("lang",), 1, 2)  # both in host memory
    while core.has_unfinished():
        core.step()
    assert vit.output_token_ids == base.output_token_ids and vit.num_cached_tokens == 32
    assert core.lora.num_slot_loads == 1 and vit.lora_key is None


def test_the_tower_adapters_images_are_keyed_apart(tiny_model, loras):
    llm = _llm(tiny_model, enable_tower_lora=True)
    image = IMAGES[0]
    base = llm.encoder.mm_hash(image)
    digests = {name: llm.inputs.tower_adapters.digest(loras[name]) for name in ("tower", "vit", "lang")}
    assert digests["lang"] is None  # no tower weights: the base's embeddings serve it
    keys = {base} | {llm.encoder.mm_hash(image, digests[name]) for name in ("tower", "vit")}
    assert len(keys) == 3


def test_without_the_flag_tower_weights_are_ignored_with_a_warning(tiny_model, adapters, loras, tmp_path, caplog):
    from safetensors.torch import load_file, save_file

    stripped = tmp_path / "stripped"  # "tower" without its tower tensors
    shutil.copytree(adapters["tower"], stripped)
    tensors = load_file(f"{stripped}/adapter_model.safetensors")
    save_file({k: v for k, v in tensors.items() if ".visual." not in k}, f"{stripped}/adapter_model.safetensors")
    llm = _llm(tiny_model)
    with caplog.at_level(logging.WARNING, logger="epd.lora"):
        full = llm.chat([MESSAGES], GREEDY, lora_request=loras["tower"])[0].outputs[0].token_ids
    assert "will be ignored" in caplog.text and "--enable-tower-lora" in caplog.text
    assert full == llm.chat([MESSAGES], GREEDY, lora_request=LoRARequest("stripped", 9, str(stripped))
                            )[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="holds no LoRA weight of the language model .*--enable-tower-lora"):
        llm.chat([MESSAGES], GREEDY, lora_request=loras["vit"])


def test_enable_tower_lora_needs_enable_lora(tiny_model):
    with pytest.raises(ValueError, match=r"enable_tower_lora \(--enable-tower-lora\) needs enable_lora"):
        _llm(tiny_model, enable_lora=False, enable_tower_lora=True)


# -- the checks, on the files (torch-free) and the tower -----------------------------------

def test_the_tower_shapes_from_the_config_are_the_towers(tiny_model):
    import torch
    from transformers import AutoConfig

    from epd.families.qwen_vl.vision import load_vision_tower
    from epd.encoders.tower_adapter import TowerShapes

    hf_config = AutoConfig.from_pretrained(tiny_model)
    shapes = TowerShapes.from_hf(hf_config)
    assert shapes == TowerShapes.of(load_vision_tower(tiny_model, hf_config, torch.float32))
    assert "merger.linear_fc1" in shapes.sizes and "deepstack_merger_list.0.linear_fc2" in shapes.sizes


def _tower_shapes(tiny_model):
    from transformers import AutoConfig

    from epd.encoders.tower_adapter import TowerShapes

    return TowerShapes.from_hf(AutoConfig.from_pretrained(tiny_model))


def _rewritten(adapter: str, tmp_path, change) -> str:
    from safetensors.torch import load_file, save_file

    out = tmp_path / "adapter"
    shutil.copytree(adapter, out)
    save_file(change(load_file(f"{out}/adapter_model.safetensors")), f"{out}/adapter_model.safetensors")
    return str(out)


def test_the_tower_part_is_read_and_paired(tiny_model, adapters):
    from epd.encoders.tower_adapter import read_tower_adapter

    spec = read_tower_adapter("vit", adapters["vit"], _tower_shapes(tiny_model), max_lora_rank=16)
    assert spec.rank == 4 and spec.scaling == 16 / 2  # use_rslora: alpha / sqrt(r)
    assert {m.rsplit(".", 1)[-1] for m in spec.tensors} == {"qkv", "linear_fc2"}
    assert "merger.linear_fc2" in spec.tensors  # a bare linear_fc2 reaches the mergers too
    lang = read_tower_adapter("lang", adapters["lang"], _tower_shapes(tiny_model), max_lora_rank=16)
    assert lang.tensors == {}


def test_tower_weights_of_a_module_lora_does_not_cover_are_refused(tiny_model, adapters, tmp_path):
    import torch

    from epd.encoders.tower_adapter import read_tower_adapter
    from epd.transport.weights.lora_files import LoRAAdapterError

    key = "base_model.model.model.visual.patch_embed.proj.lora_A.weight"  # the patch convolution
    path = _rewritten(adapters["vit"], tmp_path, lambda t: {**t, key: torch.zeros(4, 8)})
    with pytest.raises(LoRAAdapterError, match=r"patch_embed.proj.lora_A.weight' adapts visual.patch_embed.proj"):
        read_tower_adapter("conv", path, _tower_shapes(tiny_model), max_lora_rank=16)


def test_tower_weights_of_another_base_are_refused_naming_the_tensor(tiny_model, adapters, tmp_path):
    import torch

    from epd.encoders.tower_adapter import read_tower_adapter
    from epd.transport.weights.lora_files import LoRAAdapterError

    def widen(tensors):
        key = next(k for k in tensors if k.endswith("blocks.0.attn.qkv.lora_A.weight"))
        return {**tensors, key: torch.zeros(4, 999)}

    path = _rewritten(adapters["vit"], tmp_path, widen)
    with pytest.raises(LoRAAdapterError, match=r"blocks.0.attn.qkv.lora_A.weight' has shape \[4, 999\].*another base"):
        read_tower_adapter("wide", path, _tower_shapes(tiny_model), max_lora_rank=16)
