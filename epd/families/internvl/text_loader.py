"""InternVL's language model filled from the release's tensors.

Names as transformers writes them (`model.language_model.*`, `lm_head.weight`)
or as the *-hf releases do (`language_model.model.*`,
`language_model.lm_head.weight`); the vision tower and the projector
(`model.vision_tower.*`, `model.multi_modal_projector.*`, or without `model.`)
are the encoder's (vision.py) and skipped here. Within the text model the
names are Qwen's, read by epd/families/qwen_vl/text_loader.py's rules (q/k/v and gate/up fused,
MoE experts in either orientation, a tied or absent head from the embeddings).
Qwen3-MoE releases store each expert apart (`mlp.experts.{e}.gate_proj`,
`up_proj`, `down_proj`): `_load_split_experts` stacks them into the layer's
fused `w13` / `w2`; fused expert tensors go through epd/families/qwen_vl/text_loader.py.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from epd.families.qwen_vl import text_loader as qwen_loader
from epd.families.qwen_vl.text_model import Qwen3VLForCausalLM, rotary_embedding
from epd.families.internvl.text_model import build_text_model, text_config
from epd.transport.weights.checkpoint import CheckpointError, iter_tensors, load_weights, materialize

_VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
                    "multi_modal_projector.")
_SPLIT_EXPERT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _rule(name: str):
    if name.startswith(_VISION_PREFIXES) or _SPLIT_EXPERT.search(name):
        return None
    return qwen_loader._text_rule(name)


def load_text_model(model_dir: str | Path, hf_config, dtype: torch.dtype,
                    device: str | torch.device = "cpu") -> Qwen3VLForCausalLM:
    """The checkpoint's language model on our decoder, weights filled, in eval mode."""
    cfg = text_config(hf_config)
    with torch.device("meta"):
        model = build_text_model(cfg)
    model = materialize(model, device, dtype)
    model.model.rotary = rotary_embedding(cfg, device=device)  # float32 tables, not weights
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    fused = {}
    for i in range(cfg.num_layers):
        fused[f"model.layers.{i}.self_attn.qkv_proj.weight"] = [q, kv, kv]
        if cfg.attention_bias:
            fused[f"model.layers.{i}.self_attn.qkv_proj.bias"] = [q, kv, kv]
        if i not in cfg.moe_layer_ids:
            fused[f"model.layers.{i}.mlp.gate_up_proj.weight"] = [cfg.intermediate_size] * 2
    load_weights(model, model_dir, _rule, fused=fused,
                 fallbacks={"lm_head.weight": "model.embed_tokens.weight"}, describe=qwen_loader._describe)
    if cfg.moe_layer_ids and not _load_split_experts(model, model_dir):
        qwen_loader._load_experts(model, model_dir)
    return model.eval()


def _load_split_experts(model: Qwen3VLForCausalLM, model_dir: str | Path) -> bool:
    """Fills every MoE layer's `w13` ([experts, 2 * inter, hidden]: gate rows, then up rows) and
    `w2` ([experts, hidden, inter]) from per-expert tensors; False when the checkpoint has none."""
    layers = model.model.layers
    filled = set()
    accept = lambda name: not name.startswith(_VISION_PREFIXES) and _SPLIT_EXPERT.search(name) is not None  # noqa: E731
    for name, tensor in iter_tensors(model_dir, accept=accept):
        m = _SPLIT_EXPERT.search(name)
        layer, expert, kind = int(m[1]), int(m[2]), m[3]
        if layer >= len(layers) or not layers[layer].is_moe or expert >= layers[layer].mlp.num_experts:
            raise CheckpointError(f"tensor {name!r}: layer {layer} has no MoE expert {expert}")
        mlp = layers[layer].mlp
        inter = mlp.w2.shape[2]
        target = {"gate_proj": mlp.w13[expert, :inter], "up_proj": mlp.w13[expert, inter:],
                  "down_proj": mlp.w2[expert]}[kind]
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        target.copy_(tensor.to(target.dtype))
        filled.add((layer, expert, kind))
    if not filled:
        return False
    for i, layer in enumerate(layers):
        for e in range(layer.mlp.num_experts if layer.is_moe else 0):
            for kind in ("gate_proj", "up_proj", "down_proj"):
                if (i, e, kind) not in filled:
                    raise CheckpointError(f"checkpoint {model_dir} is missing tensor "
                                          f"'model.language_model.layers.{i}.mlp.experts.{e}.{kind}.weight'")
    return True
