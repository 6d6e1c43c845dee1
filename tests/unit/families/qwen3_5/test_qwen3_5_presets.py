"""The Qwen3.5 presets' config.json says what the releases say (vLLM reads keys transformers does
not), their shapes hold together, and a config EPD would serve wrong is refused by name."""
from __future__ import annotations

import pytest

from epd.families.qwen3_5.presets import PRESETS, _hf_config
from epd.families.qwen3_5.text_model import FULL, TextConfig

# Text-config keys of the Qwen3.5 releases that change what vLLM builds (Qwen3.5-35B-A3B's config.json;
# MoE releases add mlp_only_layers). vLLM drops or mis-sizes weights where one is missing or other.
RELEASE_TEXT = {"attn_output_gate": True, "attention_bias": False, "mamba_ssm_dtype": "float32"}


def _config(preset: str):
    import transformers

    ids = {t: i for i, t in enumerate(["<|endoftext|>", "<|im_end|>", "<|image_pad|>", "<|video_pad|>",
                                       "<|vision_start|>", "<|vision_end|>"])}
    p = PRESETS[preset]
    config_cls, _, kwargs = _hf_config(p, ids, vocab_size=p.vocab_size or p.tokenizer_vocab + 64)
    assert config_cls in (transformers.Qwen3_5Config, transformers.Qwen3_5MoeConfig)
    return config_cls(**kwargs)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_the_presets_config_says_the_release_keys(preset):
    written = _config(preset).to_dict()
    text, vision = written["text_config"], written["vision_config"]
    assert {k: text.get(k) for k in RELEASE_TEXT} == RELEASE_TEXT
    interval = text["full_attention_interval"]
    assert [t == "full_attention" for t in text["layer_types"]] == [
        (i + 1) % interval == 0 for i in range(text["num_hidden_layers"])]
    assert vision["deepstack_visual_indexes"] == []
    assert text["rope_parameters"]["mrope_interleaved"] is True
    if PRESETS[preset].family == "qwen3_5_moe":
        assert text["mlp_only_layers"] == []


@pytest.mark.parametrize("preset", ["qwen3.5-small", "qwen3.5-moe-small"])
def test_small_presets_shape(preset):
    """~768 hidden, 12 layers (3 full attention), a quarter of each head rotating over M-RoPE's
    three sections, 16-pixel patches merged 2x2: a 512x512 image is 256 tokens."""
    p = PRESETS[preset]
    cfg = TextConfig.from_hf(_config(preset))
    assert (cfg.hidden_size, cfg.num_layers, cfg.layer_types.count(FULL)) == (768, 12, 3)
    assert cfg.rotary_dim == 2 * sum(cfg.mrope_section) == cfg.head_dim // 4
    assert (p.max_pixels ** 0.5 // p.patch_size // 2) ** 2 == 256
    assert cfg.num_experts == (16 if p.family == "qwen3_5_moe" else 0)


@pytest.mark.parametrize("key, value, message", [
    ("attn_output_gate", False, "attn_output_gate false"),
    ("mlp_only_layers", [0], "mlp_only_layers"),
])
def test_a_config_served_wrong_is_refused_by_name(key, value, message):
    config = _config("qwen3.5-moe-tiny")
    setattr(config.text_config, key, value)
    with pytest.raises(ValueError, match=message):
        TextConfig.from_hf(config)


@pytest.mark.parametrize("preset", ["qwen3.5-tiny", "qwen3.5-moe-tiny"])
def test_the_api_reads_the_projection_shapes(preset):
    """`epd serve` checks --lora-modules against ProjectionShapes.from_hf before any worker starts;
    Qwen3.5-MoE's text config has no intermediate_size, and every one of its layers is routed."""
    from epd.engine.lora.adapter import ProjectionShapes

    shapes = ProjectionShapes.from_hf(_config(preset))
    moe = PRESETS[preset].family == "qwen3_5_moe"
    assert shapes.moe_layer_ids == frozenset(range(4) if moe else ())
    assert shapes.sizes["up_proj"] == (64, 0 if moe else 128)


# config.json values of the releases (Qwen3.6-35B-A3B has Qwen3.5-35B-A3B's topology)
RELEASES = {
    "qwen3.5-27b": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4,
                        head_dim=256, intermediate_size=17408, linear_num_key_heads=16, linear_num_value_heads=48,
                        linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320),
    "qwen3.5-35b-a3b": dict(hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
                            head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                            linear_value_head_dim=128, num_experts=256, num_experts_per_tok=8,
                            moe_intermediate_size=512, shared_expert_intermediate_size=512, vocab_size=248320),
}
RELEASE_VISION = dict(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304, patch_size=16,
                      num_position_embeddings=2304)


@pytest.mark.parametrize("preset, release", [("qwen3.5-27b", "qwen3.5-27b"), ("qwen3.5-35b-a3b", "qwen3.5-35b-a3b"),
                                             ("qwen3.6-35b-a3b", "qwen3.5-35b-a3b")])
def test_real_shape_presets_have_the_releases_shapes(preset, release):
    """The config only (their weights are tens of GB: written on a lent GPU's host, never here)."""
    from epd.engine.lora.adapter import ProjectionShapes

    p = PRESETS[preset]
    config = _config(preset)
    text, vision = config.to_dict()["text_config"], config.to_dict()["vision_config"]
    want = RELEASES[release]
    assert {k: text[k] for k in want} == want
    assert {k: vision[k] for k in RELEASE_VISION} == RELEASE_VISION and vision["out_hidden_size"] == p.hidden_size
    cfg = TextConfig.from_hf(config)
    assert (cfg.layer_types.count(FULL), cfg.rotary_dim, cfg.mrope_section) == (p.num_layers // 4, 64, (11, 11, 10))
    assert ProjectionShapes.from_hf(config) == ProjectionShapes.of(cfg)
    assert p.dtype == "bfloat16" and p.family == ("qwen3_5_moe" if "a3b" in preset else "qwen3_5")


@pytest.mark.parametrize("qwen3_5_model", ["qwen3.5-tiny"], indirect=True)
def test_the_release_template_and_its_thinking_switch(qwen3_5_model, tmp_path):
    """The preset writes the release's template: a generation prompt that opens `<think>`, or with
    chat_template_kwargs {"enable_thinking": false} (vLLM's way) an empty thinking block; the
    release's sampling defaults are read from its generation_config.json."""
    import json
    from pathlib import Path

    from transformers import AutoTokenizer

    from epd import LLM
    from epd.families.qwen3_5.chat_template import CHAT_TEMPLATE
    from epd.inputs.sampling_defaults import SamplingDefaults
    from epd.transport.wire.sampling import SamplingParams

    assert (Path(qwen3_5_model) / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    llm = LLM(qwen3_5_model, dtype="float32", num_kv_blocks=16)
    decode = AutoTokenizer.from_pretrained(qwen3_5_model).decode
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    params = SamplingParams(max_tokens=1, temperature=0)
    thinking = decode(llm.chat(messages, params)[0].prompt_token_ids)
    off = decode(llm.chat(messages, params, chat_template_kwargs={"enable_thinking": False})[0].prompt_token_ids)
    assert thinking == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" \
                       "<|im_start|>assistant\n<think>\n"
    assert off == thinking + "\n</think>\n\n"
    release = {"do_sample": True, "temperature": 1.0, "top_k": 20, "top_p": 0.95}  # Qwen3.5's generation_config
    copy = tmp_path / "release"
    copy.mkdir()
    for path in Path(qwen3_5_model).iterdir():
        if path.name != "generation_config.json":
            (copy / path.name).symlink_to(path)
    gen = json.loads((Path(qwen3_5_model) / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps({**gen, **release}))
    # temperature 1.0 is vLLM's default already: only what differs from it is overridden
    assert SamplingDefaults.load(str(copy)).overridden() == {"top_k": 20, "top_p": 0.95}
