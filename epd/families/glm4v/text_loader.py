"""GLM-4.1V's and GLM-4.5V's language models from a checkpoint: the release's tensor names -> our parameters.

A release holds `model.language_model.*` (the decoder), `model.visual.*` (the
tower: not ours) and `lm_head.weight`. q, k and v (weights and biases) are
stacked here into `qkv_proj`. GLM-4.1V's MLP ships its gate/up projection
fused (`mlp.gate_up_proj`); GLM-4.5V's dense and shared-expert MLPs ship
`gate_proj` and `up_proj`, stacked here, and its routed experts one tensor
each (`mlp.experts.E.gate_proj.weight`, `up_proj`, `down_proj`), stacked into
the MoE block's `w13` / `w2`; its router (`mlp.gate.weight`,
`mlp.gate.e_score_correction_bias`) stays float32, as transformers keeps it.
Layers past `num_hidden_layers` (GLM-4.5V's multi-token-prediction layer,
which transformers skips too) are not read. A tied or absent `lm_head` takes
the embedding.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from epd.families.glm4v.positions import positions
from epd.families.glm4v.text_model import Glm4vForCausalLM, TextConfig, rotary_embedding
from epd.transport.weights.checkpoint import (CheckpointError, fused_name, iter_tensors, load_weights, materialize,
                                              piece_name)

_TEXT_PREFIX = "model.language_model."
_LAYER = re.compile(r"layers\.(\d+)\.")
# filled into the MoE blocks' buffers by _load_moe_buffers, not by load_weights
_BUFFERS = re.compile(r"layers\.(\d+)\.mlp\.(?:experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight"
                      r"|gate\.(e_score_correction_bias))$")


def _rule_for(num_layers: int):
    """The name rule: a checkpoint tensor's (our parameter, piece of a fused one), or None: not ours to load."""

    def rule(name: str) -> tuple[str, int | None] | None:
        if name == "lm_head.weight":
            return name, None
        if not name.startswith(_TEXT_PREFIX):
            return None  # the vision tower
        rest = name[len(_TEXT_PREFIX):]
        layer = _LAYER.match(rest)
        if (layer and int(layer[1]) >= num_layers) or _BUFFERS.match(rest):
            return None  # a multi-token-prediction layer; or an MoE buffer
        fused = fused_name(rest)  # q/k/v, and gate/up of the dense and the shared-expert MLPs
        if fused:
            return "model." + fused[0], fused[1]
        return "model." + rest, None

    return rule


def _describe(param: str, shard: int | None) -> str:
    """The checkpoint name expected for (our parameter, fused piece), for error messages."""
    if param == "lm_head.weight":
        return param
    name = _TEXT_PREFIX + param[len("model."):]
    return name if shard is None else piece_name(name, shard)


def load_text_model(model_dir: str | Path, hf_config, dtype: torch.dtype,
                    device: str | torch.device = "cpu") -> Glm4vForCausalLM:
    """Our GLM-4.1V or GLM-4.5V language model, weights filled from `model_dir`, in eval mode."""
    cfg = TextConfig.from_hf(hf_config)
    with torch.device("meta"):
        model = Glm4vForCausalLM(cfg, positions(hf_config))
    model = materialize(model, device, dtype)
    model.model.rotary = rotary_embedding(cfg, device=device)  # float32 tables, not weights
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    fused = {}
    for i, layer in enumerate(model.model.layers):
        fused[f"model.layers.{i}.self_attn.qkv_proj.weight"] = [q, kv, kv]
        if cfg.attention_bias:
            fused[f"model.layers.{i}.self_attn.qkv_proj.bias"] = [q, kv, kv]
        if layer.is_moe:
            fused[f"model.layers.{i}.mlp.shared_experts.gate_up_proj.weight"] = \
                [cfg.moe_intermediate_size * cfg.num_shared_experts] * 2
            router = layer.mlp
            router.gate.weight = nn.Parameter(torch.empty_like(router.gate.weight, dtype=torch.float32))
            router.e_score_correction_bias = torch.empty_like(router.e_score_correction_bias, dtype=torch.float32)
        elif cfg.moe_layer_ids:  # GLM-4.5V's dense layers: gate and up apart in the checkpoint
            fused[f"model.layers.{i}.mlp.gate_up_proj.weight"] = [cfg.intermediate_size] * 2
    load_weights(model, model_dir, _rule_for(cfg.num_layers), fused=fused,
                 fallbacks={"lm_head.weight": "model.embed_tokens.weight"}, describe=_describe)
    if cfg.moe_layer_ids:
        _load_moe_buffers(model, model_dir)
    return model.eval()


def _load_moe_buffers(model: Glm4vForCausalLM, model_dir: str | Path) -> None:
    """Fills every MoE block's experts (`w13`: gate rows then up rows, `w2`) and router bias."""
    layers, inter = model.model.layers, model.cfg.moe_intermediate_size
    filled = set()

    def accept(name: str) -> bool:
        return name.startswith(_TEXT_PREFIX) and _BUFFERS.match(name[len(_TEXT_PREFIX):]) is not None

    for name, tensor in iter_tensors(model_dir, accept=accept):
        m = _BUFFERS.match(name[len(_TEXT_PREFIX):])
        i = int(m[1])
        if i >= len(layers):
            continue  # a multi-token-prediction layer
        if not layers[i].is_moe:
            raise CheckpointError(f"tensor {name!r}: layer {i} has no MoE block")
        block = layers[i].mlp
        if m[4]:
            target, key = block.e_score_correction_bias, (i, "bias")
        else:
            expert = int(m[2])
            if expert >= block.num_experts:
                raise CheckpointError(f"tensor {name!r}: layer {i} has {block.num_experts} experts")
            rows = {"gate_proj": slice(0, inter), "up_proj": slice(inter, 2 * inter)}.get(m[3])
            target = block.w2[expert] if rows is None else block.w13[expert, rows]
            key = (i, expert, m[3])
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        target.copy_(tensor.to(target.dtype))
        filled.add(key)
    for i, layer in enumerate(layers):
        if not layer.is_moe:
            continue
        wanted = [((i, "bias"), f"layers.{i}.mlp.gate.e_score_correction_bias")]
        wanted += [((i, e, kind), f"layers.{i}.mlp.experts.{e}.{kind}.weight")
                   for e in range(layer.mlp.num_experts) for kind in ("gate_proj", "up_proj", "down_proj")]
        missing = [name for key, name in wanted if key not in filled]
        if missing:
            raise CheckpointError(f"checkpoint {model_dir} is missing tensor '{_TEXT_PREFIX}{missing[0]}'"
                                  + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
