"""Gemma 3's language model from a checkpoint: its tensor names -> our parameters.

Both layouts transformers reads: the current one (`model.language_model.*`)
and the release's (`language_model.model.*`, which transformers itself still
writes); the vision tower's and projector's tensors are vision.py's. q/k/v and
gate/up are stacked into our fused projections; the head is tied (a
checkpoint's own `lm_head.weight`, where one has it, is taken instead).
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from epd.engine.models.positions import RopePositions
from epd.families.gemma3.text_model import Gemma3ForCausalLM, TextConfig, rotary_embeddings
from epd.transport.weights.checkpoint import load_weights, materialize

_TEXT_PREFIXES = ("model.language_model.", "language_model.model.")
_HEADS = ("lm_head.weight", "language_model.lm_head.weight")
_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
_GATE_UP = {"gate_proj": 0, "up_proj": 1}


def text_rule(name: str):
    """A checkpoint name -> (our parameter, fused piece or None), None for what is not ours."""
    if name in _HEADS:
        return "lm_head.weight", None
    prefix = next((p for p in _TEXT_PREFIXES if name.startswith(p)), None)
    if prefix is None:
        return None  # the vision tower and the projector
    rest = name[len(prefix):]
    m = re.match(r"layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj)\.weight$", rest)
    if m:
        return f"model.layers.{m[1]}.self_attn.qkv_proj.weight", _QKV[m[2]]
    m = re.match(r"layers\.(\d+)\.mlp\.(gate_proj|up_proj)\.weight$", rest)
    if m:
        return f"model.layers.{m[1]}.mlp.gate_up_proj.weight", _GATE_UP[m[2]]
    return "model." + rest, None


def _describe(param: str, shard: int | None) -> str:
    """The checkpoint name (transformers' current layout) expected for (our parameter, piece)."""
    if param == "lm_head.weight":
        return param
    name = "model.language_model." + param[len("model."):]
    if shard is not None:
        fused, pieces = ("qkv_proj", list(_QKV)) if "qkv_proj" in name else ("gate_up_proj", list(_GATE_UP))
        name = name.replace(fused, pieces[shard])
    return name


def load_text_model(model_dir: str | Path, hf_config, dtype: torch.dtype,
                    device: str | torch.device = "cpu") -> Gemma3ForCausalLM:
    """The checkpoint's language model, weights filled, in eval mode."""
    cfg = TextConfig.from_hf(hf_config)
    with torch.device("meta"):
        model = Gemma3ForCausalLM(cfg, RopePositions())
    model = materialize(model, device, dtype)
    model.model.rotary = rotary_embeddings(cfg, device=device)  # float32 tables, not weights
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    fused = {}
    for i in range(cfg.num_layers):
        fused[f"model.layers.{i}.self_attn.qkv_proj.weight"] = [q, kv, kv]
        fused[f"model.layers.{i}.mlp.gate_up_proj.weight"] = [cfg.intermediate_size] * 2
    load_weights(model, model_dir, text_rule, fused=fused,
                 fallbacks={"lm_head.weight": "model.embed_tokens.weight"}, describe=_describe)
    return model.eval()
