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
    config_cls, _, kwargs = _hf_config(PRESETS[preset], ids, vocab_size=PRESETS[preset].tokenizer_vocab + 64)
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
