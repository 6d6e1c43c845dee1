"""GLM-4.1V's language model from a checkpoint: the release's tensor names -> our parameters.

A release holds `model.language_model.*` (the decoder), `model.visual.*` (the
tower: not ours) and `lm_head.weight`; the MLP's gate/up projection is
already fused (`mlp.gate_up_proj`), q, k and v (weights and biases) are
stacked here into `qkv_proj`. A tied or absent `lm_head` takes the embedding.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from epd.families.glm4v.positions import positions
from epd.families.glm4v.text_model import Glm4vForCausalLM, TextConfig, rotary_embedding
from epd.transport.weights.checkpoint import load_weights, materialize

_TEXT_PREFIX = "model.language_model."
_QKV = re.compile(r"layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj)\.(weight|bias)$")
_QKV_SHARD = {"q_proj": 0, "k_proj": 1, "v_proj": 2}


def _rule(name: str) -> tuple[str, int | None] | None:
    """A checkpoint tensor's (our parameter, piece of a fused one), or None: not the language model's."""
    if name == "lm_head.weight":
        return name, None
    if not name.startswith(_TEXT_PREFIX):
        return None  # the vision tower
    rest = name[len(_TEXT_PREFIX):]
    m = _QKV.match(rest)
    if m:
        return f"model.layers.{m[1]}.self_attn.qkv_proj.{m[3]}", _QKV_SHARD[m[2]]
    return "model." + rest, None


def _describe(param: str, shard: int | None) -> str:
    """The checkpoint name expected for (our parameter, fused piece), for error messages."""
    if param == "lm_head.weight":
        return param
    name = _TEXT_PREFIX + param[len("model."):]
    return name if shard is None else name.replace("qkv_proj", list(_QKV_SHARD)[shard])


def load_text_model(model_dir: str | Path, hf_config, dtype: torch.dtype,
                    device: str | torch.device = "cpu") -> Glm4vForCausalLM:
    """Our GLM-4.1V language model, weights filled from `model_dir`, in eval mode."""
    cfg = TextConfig.from_hf(hf_config)
    with torch.device("meta"):
        model = Glm4vForCausalLM(cfg, positions(hf_config))
    model = materialize(model, device, dtype)
    model.model.rotary = rotary_embedding(cfg, device=device)  # float32 tables, not weights
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    fused = {}
    for i in range(cfg.num_layers):
        fused[f"model.layers.{i}.self_attn.qkv_proj.weight"] = [q, kv, kv]
        fused[f"model.layers.{i}.self_attn.qkv_proj.bias"] = [q, kv, kv]
    load_weights(model, model_dir, _rule, fused=fused, fallbacks={"lm_head.weight": "model.embed_tokens.weight"},
                 describe=_describe)
    return model.eval()
