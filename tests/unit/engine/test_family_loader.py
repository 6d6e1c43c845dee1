"""Loading the newer families: MoE experts in either orientation, a missing
expert tensor named, Qwen2.5-VL's q/k/v biases and a tied head."""
from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from testkit.family_checkpoints import family_checkpoint
from testkit.hf_reference import hf_greedy, hf_prompt_logits
from safetensors.torch import load_file, save_file

from epd.engine.loader import load_language_model
from epd.families.qwen_vl.presets import PRESETS
from epd.tools.make_model import make_model
from epd.transport.weights.checkpoint import CheckpointError
from epd.transport.wire.sampling import SamplingParams


def _config(path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def _edited_copy(src: str, tmp_path, edit) -> str:
    out = tmp_path / "ckpt"
    shutil.copytree(src, out)
    tensors = load_file(str(out / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def test_experts_load_in_the_published_orientation(tmp_path):
    """Published Qwen3-VL-MoE checkpoints store [experts, hidden, 2 * inter] and
    [experts, inter, hidden]; transformers saves the transpose. Both load the same."""
    src = family_checkpoint("qwen3_vl_moe")

    def transpose_experts(t):
        for name in [n for n in t if ".mlp.experts." in n]:
            t[name] = t[name].transpose(1, 2).contiguous()

    published = load_language_model(_edited_copy(src, tmp_path, transpose_experts), _config(src), torch.float32)
    saved = load_language_model(src, _config(src), torch.float32)
    ref = load_file(f"{src}/model.safetensors")
    moe = [i for i, layer in enumerate(saved.model.layers) if layer.is_moe]
    assert moe == [0, 2], "layer 1 is dense (mlp_only_layers)"
    for i in moe:
        a, b = published.model.layers[i].mlp, saved.model.layers[i].mlp
        assert torch.equal(a.w13, b.w13) and torch.equal(a.w2, b.w2)
        assert torch.equal(b.w13, ref[f"model.language_model.layers.{i}.mlp.experts.gate_up_proj"])
        assert torch.equal(b.gate.weight, ref[f"model.language_model.layers.{i}.mlp.gate.weight"])


def test_missing_expert_tensor_is_named(tmp_path):
    src = family_checkpoint("qwen3_vl_moe")
    name = "model.language_model.layers.2.mlp.experts.down_proj"
    path = _edited_copy(src, tmp_path, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_language_model(path, _config(path), torch.float32)


def test_qwen2_5_biases_are_fused_into_qkv():
    src = family_checkpoint("qwen2_5_vl")
    model = load_language_model(src, _config(src), torch.float32)
    ref = load_file(f"{src}/model.safetensors")
    bias = model.model.layers[1].self_attn.qkv_proj.bias
    q, v = ref["model.layers.1.self_attn.q_proj.bias"], ref["model.layers.1.self_attn.v_proj.bias"]
    assert torch.equal(bias[:q.shape[0]], q) and torch.equal(bias[-v.shape[0]:], v)
    assert not hasattr(model.model.layers[1].self_attn, "q_norm")


def test_qwen2_5_tied_head_matches_transformers(tmp_path):
    preset = dataclasses.replace(PRESETS["qwen2.5-vl-tiny"], tie_word_embeddings=True, num_kv_heads=4)
    path = str(make_model(tmp_path / "tied", preset, seed=5))
    assert "lm_head.weight" not in load_file(f"{path}/model.safetensors")
    model = load_language_model(path, _config(path), torch.float32)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    from epd import LLM

    messages = [{"role": "user", "content": "A tied head, a short answer."}]
    llm = LLM(path, num_kv_blocks=16, dtype="float32", device="cpu")
    out = llm.chat([messages], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == hf_greedy(path, messages, [], num_tokens=8)
    ids, _ = hf_prompt_logits(path, messages, [])
    assert out.prompt_token_ids == ids
