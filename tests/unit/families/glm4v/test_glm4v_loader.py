"""GLM's language-model loader on release layouts (epd/families/glm4v/text_loader.py):
GLM-4.5V's checkpoint split over shards with its multi-token-prediction layer
loads to the same logits; a missing expert, a misshaped tensor and an
unsupported rope are refused naming what is wrong; the release's config keys read as the made ones,
and the presets write the release's attention_bias."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from epd.families.glm4v.presets import PRESETS
from epd.families.glm4v.text_loader import load_text_model
from epd.tools.make_model import make_model
from epd.transport.weights.checkpoint_error import CheckpointError

PREFIX = "model.language_model."


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory) -> str:
    return str(make_model(tmp_path_factory.mktemp("glm4v-moe"), PRESETS["glm4v-moe-tiny"], seed=2))


def _hf_config(model_dir):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def _rewrite(src: str, dst, edit) -> str:
    """A copy of checkpoint `src` at `dst` whose tensors are `edit(tensors)`, split over two shards."""
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    tensors = edit(load_file(f"{src}/model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        save_file({k: tensors[k].contiguous() for k in keys}, str(dst / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return str(dst)


def _logits(model, ids: list[int]) -> torch.Tensor:
    from epd.engine.attention import get_backend
    from epd.engine.attention.metadata import AttentionMetadata
    from epd.engine.layers.forward_batch import ForwardBatch

    cfg, n = model.cfg, len(ids)
    kv = [(torch.zeros(2, 16, cfg.num_kv_heads, cfg.head_dim), torch.zeros(2, 16, cfg.num_kv_heads, cfg.head_dim))
          for _ in range(cfg.num_layers)]
    batch = ForwardBatch(positions=model.positions.prompt_positions(n)[0],
                         attn_meta=AttentionMetadata.build([n], [n], [[1, 0]], 16), backend=get_backend("torch"),
                         kv_caches=kv)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), batch))


def test_sharded_release_with_an_mtp_layer_loads_the_same_model(moe_checkpoint, tmp_path):
    def add_mtp_layer(tensors):  # GLM-4.5V ships layer num_hidden_layers: multi-token prediction
        layer = {k.replace("layers.2.", "layers.3."): v.clone() for k, v in tensors.items() if ".layers.2." in k}
        return {**tensors, **layer}

    sharded = _rewrite(moe_checkpoint, tmp_path / "sharded", add_mtp_layer)
    ids = [5, 77, 301, 9, 18, 640, 2, 2, 31]
    expected = _logits(load_text_model(moe_checkpoint, _hf_config(moe_checkpoint), torch.float32), ids)
    model = load_text_model(sharded, _hf_config(sharded), torch.float32)
    assert model.model.layers[2].mlp.gate.weight.dtype == torch.float32
    assert torch.equal(_logits(model, ids), expected)


def test_a_missing_expert_is_named(moe_checkpoint, tmp_path):
    name = PREFIX + "layers.1.mlp.experts.5.up_proj.weight"
    broken = _rewrite(moe_checkpoint, tmp_path / "broken", lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(CheckpointError, match=f"missing tensor '{name}'"):
        load_text_model(broken, _hf_config(broken), torch.float32)


def test_a_misshaped_router_bias_is_named(moe_checkpoint, tmp_path):
    name = PREFIX + "layers.2.mlp.gate.e_score_correction_bias"
    broken = _rewrite(moe_checkpoint, tmp_path / "broken", lambda t: {**t, name: torch.zeros(3)})
    with pytest.raises(CheckpointError, match="e_score_correction_bias' has shape"):
        load_text_model(broken, _hf_config(broken), torch.float32)


def test_an_unsupported_rope_is_refused(moe_checkpoint):
    config = _hf_config(moe_checkpoint)
    config.text_config.rope_parameters = {**config.text_config.rope_parameters, "rope_type": "yarn"}
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        load_text_model(moe_checkpoint, config, torch.float32)


def test_the_release_config_keys_give_the_same_text_config():
    """GLM-4.1V-9B's config.json keeps partial_rotary_factor and rope_theta beside the text config's other
    keys and the sections under rope_scaling ("type"); transformers folds them into rope_parameters."""
    from transformers import Glm4vConfig

    from epd.families.glm4v.text_model import TextConfig

    text = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=2, num_hidden_layers=40,
                intermediate_size=13696, vocab_size=151552, max_position_embeddings=65536, rms_norm_eps=1e-5)
    release = Glm4vConfig(text_config=dict(text, partial_rotary_factor=0.5, rope_theta=10000,
                                           rope_scaling={"type": "default", "mrope_section": [8, 12, 12]}))
    made = Glm4vConfig(text_config=dict(text, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                               "partial_rotary_factor": 0.5,
                                                               "mrope_section": [8, 12, 12]}))
    cfg = TextConfig.from_hf(release)
    assert cfg == TextConfig.from_hf(made)
    assert (cfg.head_dim, cfg.rotary_dim, cfg.mrope_section, cfg.rope_theta) == (128, 64, (8, 12, 12), 10000.0)


@pytest.mark.parametrize("preset", ["glm4v-tiny", "glm4v-moe-tiny"])
def test_the_presets_config_says_attention_bias_as_the_releases_do(preset, tmp_path):
    """The releases' text config says `attention_bias: true`. transformers' GLM-4.1V has q/k/v biases
    whatever it says; vLLM's reads them only where it says so, and without the key served other text."""
    from epd.families.glm4v.presets import _config

    ids = {t: i for i, t in enumerate(["<|endoftext|>", "<|image|>", "<|video|>", "<|begin_of_image|>",
                                       "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>"])}
    assert _config(PRESETS[preset], ids, vocab_size=1024)["text_config"]["attention_bias"] is True
