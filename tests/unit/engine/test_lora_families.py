"""LoRA on the language model of the newer families, as users target it: a plain list of
module names, which PEFT also applies to the vision tower's projections of the same names
(SigLIP's and InternViT's q/k/v, GLM's tower down_proj). GLM-4.1V's transformers model fuses
gate and up, so its adapters target `gate_up_proj` (vLLM's glm4_1v packs it as itself).
On text prompts the tower plays no part: EPD, which leaves the tower's tensors to
--enable-tower-lora, gives transformers + peft's greedy tokens, beside the base model in one
batch. The tower's tensors are recognised by each family's name for it, never read as a
language-model layer's."""
from __future__ import annotations

import pytest
from testkit.lora_adapters import make_adapter, peft_greedy

from epd.tools.make_model import make_model
from epd.transport.wire.lora_request import LoRARequest
from epd.transport.wire.sampling import SamplingParams

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
CASES = {  # preset -> the adapter's target_modules, and the tower tensor PEFT makes of them too
    "glm4v-tiny": (ATTENTION + ("gate_up_proj", "down_proj"), ".visual.blocks.0.mlp.down_proj."),
    "internvl-tiny": (ATTENTION + ("gate_proj", "up_proj", "down_proj"), ".vision_tower.encoder.layer.0."),
    "gemma3-tiny": (ATTENTION + ("gate_proj", "up_proj", "down_proj"), ".vision_tower.encoder.layers.0.self_attn."),
}
PROMPTS = [list(range(10, 30)), [5, 900, 33, 7, 512, 64, 3, 3, 8] * 5]
NUM_TOKENS = 6


@pytest.fixture(scope="module", params=sorted(CASES))
def model_and_adapter(request, tmp_path_factory) -> tuple[str, str, str]:
    preset = request.param
    model_dir = str(make_model(tmp_path_factory.mktemp(preset) / "ckpt", preset, seed=3))
    adapter = make_adapter(model_dir, tmp_path_factory.mktemp(preset) / "adapter", CASES[preset][0], r=4, seed=5)
    return preset, model_dir, adapter


def test_a_language_model_adapter_gives_peft_tokens(model_and_adapter):
    import json

    from safetensors import safe_open
    from transformers import AutoConfig

    from epd import LLM
    from epd.engine.lora.adapter import ProjectionShapes

    preset, model_dir, adapter = model_and_adapter
    with safe_open(f"{adapter}/adapter_model.safetensors", "pt") as f:
        assert any(CASES[preset][1] in key for key in f.keys()), "peft was meant to adapt the tower too"
    assert json.load(open(f"{adapter}/adapter_config.json"))["r"] == 4
    names = [None, None, "sql", "sql"]
    expected = peft_greedy(model_dir, {"sql": adapter}, PROMPTS * 2, names, NUM_TOKENS)
    assert expected[:2] != expected[2:], "the adapter was meant to change the answers"
    llm = LLM(model_dir, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8, num_kv_blocks=64)
    lora = LoRARequest("sql", 1, adapter)
    outs = llm.generate(PROMPTS * 2, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True),
                        lora_request=[None, None, lora, lora])
    assert [o.outputs[0].token_ids for o in outs] == expected
    # the API process checks adapters against the config's shapes (no torch): they are the model's
    assert ProjectionShapes.from_hf(AutoConfig.from_pretrained(model_dir)) == ProjectionShapes.of(
        llm.engine.runner.model.cfg)



@pytest.mark.parametrize("family", ["glm4v", "glm4v_moe", "internvl-tiny", "internvl-moe-tiny"])
def test_the_api_sees_the_models_shapes_and_moe_layers(family, tmp_path):
    """ProjectionShapes.from_hf (the API process: no torch) equals the engine's text config's:
    GLM-4.1V's head_dim (hidden / heads whatever head_dim says), the MoE layers of GLM-4.5V
    (after first_k_dense_replace) and of InternVL on Qwen3-MoE, where gate/up/down are refused."""
    from transformers import AutoConfig

    from epd.engine.lora.adapter import ProjectionShapes
    from epd.families.glm4v.text_model import TextConfig as GlmTextConfig
    from epd.families.internvl.text_model import text_config
    from testkit.family_checkpoints import family_checkpoint

    if family.startswith("internvl"):
        config = AutoConfig.from_pretrained(make_model(tmp_path / "ckpt", family, seed=0))
        cfg = text_config(config)
    else:
        config = AutoConfig.from_pretrained(family_checkpoint(family))
        cfg = GlmTextConfig.from_hf(config)
    shapes = ProjectionShapes.from_hf(config)
    assert shapes == ProjectionShapes.of(cfg)
    assert bool(shapes.moe_layer_ids) == ("moe" in family)
