"""The loader fills every parameter or names the tensor that is wrong."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from epd.engine.loader import load_language_model
from epd.families.qwen_vl.vision import load_vision_tower
from epd.transport.weights.checkpoint import CheckpointError


def _broken_copy(tiny_model, tmp_path, edit) -> str:
    out = tmp_path / "ckpt"
    shutil.copytree(tiny_model, out)
    tensors = load_file(str(out / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def _config(path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def test_loads_tiny_checkpoint(tiny_model):
    model = load_language_model(tiny_model, _config(tiny_model), torch.float32)
    ref = load_file(f"{tiny_model}/model.safetensors")
    q = ref["model.language_model.layers.1.self_attn.q_proj.weight"]
    v = ref["model.language_model.layers.1.self_attn.v_proj.weight"]
    qkv = model.model.layers[1].self_attn.qkv_proj.weight
    assert torch.equal(qkv[: q.shape[0]], q) and torch.equal(qkv[-v.shape[0]:], v)
    assert torch.equal(model.lm_head.weight, ref["lm_head.weight"])


def test_missing_tensor_is_named(tiny_model, tmp_path):
    name = "model.language_model.layers.2.self_attn.k_proj.weight"
    path = _broken_copy(tiny_model, tmp_path, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_language_model(path, _config(path), torch.float32)


def test_misshaped_tensor_is_named(tiny_model, tmp_path):
    name = "model.visual.blocks.1.mlp.linear_fc1.weight"
    path = _broken_copy(tiny_model, tmp_path, lambda t: t.__setitem__(name, torch.zeros(3, 3)))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.") + r".*\(3, 3\)"):
        load_vision_tower(path, _config(path), torch.float32)


def test_tied_head_takes_the_embedding(tiny_model, tmp_path):
    path = _broken_copy(tiny_model, tmp_path, lambda t: t.pop("lm_head.weight"))
    model = load_language_model(path, _config(path), torch.float32)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_bfloat16_load_keeps_rotary_tables_in_float32(tiny_model):
    model = load_language_model(tiny_model, _config(tiny_model), torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.rotary.inv_freq.dtype == torch.float32


def test_profile_forward_runs_a_full_token_budget(tiny_model):
    """The pass that sizes the GPU KV cache, exercised on CPU."""
    from epd.engine.config import EngineConfig
    from epd.engine.kv_cache_sizer import profile_forward

    model = load_language_model(tiny_model, _config(tiny_model), torch.float32)
    logits = profile_forward(model, EngineConfig.from_flat(max_num_batched_tokens=64, max_num_seqs=8, device="cpu"), "cpu")
    assert logits.shape == (8, model.cfg.vocab_size) and torch.isfinite(logits).all()
