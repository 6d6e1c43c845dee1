"""Gemma 3's language model from a checkpoint: its tensor names -> our parameters.

Both layouts transformers reads: the current one (`model.language_model.*`)
and the release's (`language_model.model.*`, which transformers itself still
writes); the vision tower's and projector's tensors are vision.py's. q/k/v and
gate/up are stacked into our fused projections; the head is tied (a
checkpoint's own `lm_head.weight`, where one has it, is taken instead).
"""
from __future__ import annotations

from pathlib import Path

import torch

from epd.engine.models.positions import RopePositions
from epd.families.gemma3.text_model import Gemma3ForCausalLM, TextConfig, rotary_embeddings
from epd.transport.weights.checkpoint import fused_name, load_weights, materialize, piece_name

_TEXT_PREFIXES = ("model.language_model.", "language_model.model.")
_HEADS = ("lm_head.weight", "language_model.lm_head.weight")


def text_rule(name: str):
    """A checkpoint name -> (our parameter, fused piece or None), None for what is not ours."""
    if name in _HEADS:
        return "lm_head.weight", None
    prefix = next((p for p in _TEXT_PREFIXES if name.startswith(p)), None)
    if prefix is None:
        return None  # the vision tower and the projector
    rest = name[len(prefix):]
    fused = fused_name(rest)
    if fused:
        return "model." + fused[0], fused[1]
    return "model." + rest, None


def _describe(param: str, shard: int | None) -> str:
    """The checkpoint name (transformers' current layout) expected for (our parameter, piece)."""
    if param == "lm_head.weight":
        return param
    name = "model.language_model." + param[len("model."):]
    return name if shard is None else piece_name(name, shard)


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
