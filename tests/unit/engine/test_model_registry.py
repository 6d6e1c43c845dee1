"""The family of a checkpoint comes from its config.json; an unsupported one
stops start-up with a message naming the supported families, not a traceback
(tests/e2e/cli/test_start_up_errors.py: the same from the `epd` command)."""
from __future__ import annotations

import pytest
from testkit.family_checkpoints import SUPPORTED
from testkit.family_checkpoints import config_only_checkpoint as _checkpoint

from epd.families.registry import FAMILIES, UnsupportedModelError, check_family

@pytest.mark.parametrize("model_type, architecture", [
    ("qwen3_vl", "Qwen3VLForConditionalGeneration"),
    ("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration"),
    ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
])
def test_family_from_model_type_or_architecture(tmp_path, model_type, architecture):
    assert check_family(_checkpoint(tmp_path, {"model_type": model_type})).model_type == model_type
    by_arch = check_family(_checkpoint(tmp_path, {"architectures": [architecture]}))
    assert by_arch.model_type == model_type and by_arch.architecture == architecture


@pytest.mark.parametrize("config", [
    {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"]},  # transformers knows it
    {"model_type": "made_up_vl"},  # transformers does not
    {},
])
def test_unsupported_family_names_the_supported_ones(tmp_path, config):
    with pytest.raises(UnsupportedModelError) as err:
        check_family(_checkpoint(tmp_path, config))
    assert "is not supported" in str(err.value)
    assert all(s in str(err.value) for s in SUPPORTED) and len(FAMILIES) == len(SUPPORTED)


@pytest.mark.parametrize("preset", ["qwen3-vl-moe-tiny", "qwen3-vl-moe-small", "qwen3-vl-30b-a3b",
                                    "qwen2.5-vl-tiny", "qwen2.5-vl-small", "qwen2.5-vl-7b"])
def test_every_new_preset_is_a_config_our_models_accept(preset):
    """The presets' configs (no weights: the published shapes are far too big
    here) are accepted by transformers and parse into our decoder and tower."""
    from epd.families.qwen_vl.vision import TOWERS
    from epd.families.qwen_vl.text_configs import text_config
    from epd.families.registry import family_of
    from epd.families.qwen_vl.presets import PRESETS, SPECIAL_TOKENS, _hf_config

    p = PRESETS[preset]
    config_cls, _, kwargs = _hf_config(p, {t: i for i, t in enumerate(SPECIAL_TOKENS)}, p.vocab_size or 1024)
    hf_config = config_cls(**kwargs)
    family = family_of(hf_config)
    text = text_config(hf_config)
    assert family.model_type == p.family and text.hidden_size == p.hidden_size
    assert text.num_heads * text.head_dim == (p.hidden_size if p.family == "qwen2_5_vl" else p.num_heads * p.head_dim)
    assert 2 * sum(text.mrope_section) == text.head_dim
    assert text.moe_layer_ids == (tuple(range(p.num_layers)) if p.num_experts else ())
    vision_cfg_cls, _ = TOWERS[p.family]
    assert vision_cfg_cls.from_hf(hf_config.vision_config).depth == p.vision_depth
