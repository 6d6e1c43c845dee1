"""Builds our Qwen3-VL language model and fills it from a safetensors checkpoint.

Checkpoint names follow transformers' layout (`model.language_model.*`,
`lm_head.weight`); q/k/v and gate/up are stacked into fused parameters; a
tied or absent `lm_head` takes the embedding. No transformers modeling code
is used: only its config class.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from epd.engine.models.qwen3_vl import MRotaryEmbedding, Qwen3VLForCausalLM, TextConfig
from epd.transport.checkpoint import load_weights

_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.")
_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
_GATE_UP = {"gate_proj": 0, "up_proj": 1}


def _text_rule(name: str):
    if name in ("lm_head.weight", "language_model.lm_head.weight"):
        return "lm_head.weight", None
    for prefix in _TEXT_PREFIXES:
        if name.startswith(prefix):
            rest = name[len(prefix):]
            break
    else:
        return None  # vision tower or other heads: not ours
    m = re.match(r"layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj)\.weight$", rest)
    if m:
        return f"model.layers.{m[1]}.self_attn.qkv_proj.weight", _QKV[m[2]]
    m = re.match(r"layers\.(\d+)\.mlp\.(gate_proj|up_proj)\.weight$", rest)
    if m:
        return f"model.layers.{m[1]}.mlp.gate_up_proj.weight", _GATE_UP[m[2]]
    return "model." + rest, None


def _describe(param: str, shard: int | None) -> str:
    """The checkpoint name expected for (our parameter, fused piece)."""
    if param == "lm_head.weight":
        return param
    name = "model.language_model." + param[len("model."):]
    if shard is not None:
        old = "qkv_proj" if "qkv_proj" in name else "gate_up_proj"
        pieces = list(_QKV) if old == "qkv_proj" else list(_GATE_UP)
        name = name.replace(old, pieces[shard])
    return name


def resolve_dtype(dtype: str, checkpoint_dtype: str) -> torch.dtype:
    name = checkpoint_dtype if dtype == "auto" else dtype
    name = {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp32": "float32",
            "fp16": "float16"}.get(name, name)
    if name not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"unsupported dtype {dtype!r} (use auto, float32, float16 or bfloat16)")
    return getattr(torch, name)


def load_language_model(model_dir: str | Path, hf_config, dtype: torch.dtype,
                        device: str | torch.device = "cpu") -> Qwen3VLForCausalLM:
    cfg = TextConfig.from_hf(hf_config)
    with torch.device("meta"):
        model = Qwen3VLForCausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    model.model.rotary = MRotaryEmbedding(cfg, device=device)  # float32 tables, not weights
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    fused = {}
    for i in range(cfg.num_layers):
        fused[f"model.layers.{i}.self_attn.qkv_proj.weight"] = [q, kv, kv]
        fused[f"model.layers.{i}.mlp.gate_up_proj.weight"] = [cfg.intermediate_size] * 2
    load_weights(model, model_dir, _text_rule, fused=fused,
                 fallbacks={"lm_head.weight": "model.embed_tokens.weight"}, describe=_describe)
    return model.eval()
