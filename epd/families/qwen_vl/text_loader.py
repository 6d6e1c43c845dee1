"""Builds a Qwen family's language model and fills it from safetensors.

Checkpoint names follow transformers' layouts (`model.language_model.*`, or
`model.*` as Qwen2.5-VL checkpoints have it, and `lm_head.weight`); q/k/v
(weights and biases) and gate/up are stacked into fused parameters; a tied
or absent `lm_head` takes the embedding. MoE experts come fused per layer
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) in either orientation:
the published one ([experts, hidden, 2 * inter]) or transformers' in-memory
one ([experts, 2 * inter, hidden]); both are read into ours (the latter). The
quantized releases store each expert's projections apart
(`mlp.experts.<e>.gate_proj.weight`, ...), read into the same buffers.
No transformers modeling code is used: only its config class.
`load_text_shard`: one tensor-parallel rank's part of a dense model, reading only
its slices of the tensors (engine/parallel/).
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from epd.families.qwen_vl.family import mrope_positions
from epd.families.qwen_vl.text_configs import text_config
from epd.families.qwen_vl.text_model import Qwen3VLForCausalLM, TextConfig, rotary_embedding
from epd.engine.parallel.layers import parallelize
from epd.engine.parallel.shard import Shard, TensorParallelError
from epd.transport.weights.checkpoint import (CheckpointError, fused_name, iter_tensors, load_weights, materialize,
                                              piece_name, quant_config_of)

_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
_VISION_PREFIXES = ("model.visual.", "visual.")
_EXPERTS = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
# one expert's projection, as the quantized releases store them (Qwen's FP8: each with its weight_scale_inv)
_EXPERT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _text_rule(name: str):
    if name in ("lm_head.weight", "language_model.lm_head.weight"):
        return "lm_head.weight", None
    if name.startswith(_VISION_PREFIXES):
        return None
    for prefix in _TEXT_PREFIXES:
        if name.startswith(prefix):
            rest = name[len(prefix):]
            break
    else:
        return None  # vision tower or other heads: not ours
    if _EXPERTS.match(rest) or _EXPERT.match(rest):
        return None  # filled by _load_experts
    fused = fused_name(rest)
    if fused:
        return "model." + fused[0], fused[1]
    return "model." + rest, None


def _describe(param: str, shard: int | None) -> str:
    """The checkpoint name expected for (our parameter, fused piece)."""
    if param == "lm_head.weight":
        return param
    name = "model.language_model." + param[len("model."):]
    return name if shard is None else piece_name(name, shard)


def load_text_model(model_dir: str | Path, hf_config, dtype: torch.dtype, device: str | torch.device = "cpu", *,
                    cfg: TextConfig | None = None, positions=None, rename=None, describe=None) -> Qwen3VLForCausalLM:
    """A family built on this decoder (Qwen2.5-Omni's thinker) gives its `cfg`, its position
    rule, `rename` (its checkpoint name -> the name a Qwen-VL checkpoint gives it, or None) and
    `describe` (our parameter, fused piece -> its checkpoint name, for errors)."""
    return _load(model_dir, hf_config, dtype, device, None, cfg=cfg, positions=positions, rename=rename,
                 describe=describe)


def load_text_shard(model_dir: str | Path, hf_config, dtype: torch.dtype, device: str | torch.device,
                    shard: Shard) -> Qwen3VLForCausalLM:
    """Rank `shard.rank`'s part of the language model: its heads, MLP rows and vocabulary run."""
    cfg = text_config(hf_config)
    if cfg.moe_layer_ids:
        raise TensorParallelError("Qwen3-VL-MoE: mixture-of-experts layers are not sharded by tensor parallelism yet")
    if quant_config_of(model_dir) is not None:
        raise TensorParallelError("a quantized checkpoint is not sharded by tensor parallelism yet")
    return _load(model_dir, hf_config, dtype, device, shard)


def _load(model_dir, hf_config, dtype, device, shard: Shard | None, *, cfg: TextConfig | None = None,
          positions=None, rename=None, describe=None) -> Qwen3VLForCausalLM:
    whole = cfg or text_config(hf_config)
    cfg = whole if shard is None else shard.local_config(whole)  # this rank's head and MLP row counts
    with torch.device("meta"):
        model = Qwen3VLForCausalLM(cfg, positions or mrope_positions(hf_config))
        if shard is not None:
            parallelize(model, shard)
    model = materialize(model, device, dtype)
    model.model.rotary = rotary_embedding(cfg, device=device)  # float32 tables, not weights
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    fused = {}
    for i in range(cfg.num_layers):
        fused[f"model.layers.{i}.self_attn.qkv_proj.weight"] = [q, kv, kv]
        if cfg.attention_bias:
            fused[f"model.layers.{i}.self_attn.qkv_proj.bias"] = [q, kv, kv]
        fused[f"model.layers.{i}.mlp.gate_up_proj.weight"] = [cfg.intermediate_size] * 2
    def rule(name: str):
        ours = name if rename is None else rename(name)
        return None if ours is None else _text_rule(ours)

    load_weights(model, model_dir, rule, fused=fused,
                 fallbacks={"lm_head.weight": "model.embed_tokens.weight"}, describe=describe or _describe,
                 narrowing=None if shard is None else shard.narrowing(whole))
    if cfg.moe_layer_ids:
        _load_experts(model, model_dir)
    return model.eval()


def _load_experts(model: Qwen3VLForCausalLM, model_dir: str | Path) -> None:
    """Fills every MoE layer's `w13` / `w2` buffers from the fused expert tensors, or from
    each expert's gate / up / down projection where the checkpoint stores them apart."""
    layers = model.model.layers
    filled = set()

    def accept(name: str) -> bool:
        return not name.startswith(_VISION_PREFIXES) and (_EXPERTS.search(name) or _EXPERT.search(name)) is not None

    for name, tensor in iter_tensors(model_dir, accept=accept):
        m = _EXPERTS.search(name) or _EXPERT.search(name)
        layer = int(m[1])
        if layer >= len(layers) or not layers[layer].is_moe:
            raise CheckpointError(f"tensor {name!r}: layer {layer} has no MoE block")
        if m.re is _EXPERT:
            _fill_expert(layers[layer].mlp, name, int(m[2]), m[3], tensor)
            filled.add((layer, m[3], int(m[2])))
            continue
        target = layers[layer].mlp.w13 if m[2] == "gate_up_proj" else layers[layer].mlp.w2
        if tuple(tensor.shape) != tuple(target.shape):
            if tensor.ndim == 3 and tuple(tensor.transpose(1, 2).shape) == tuple(target.shape):
                tensor = tensor.transpose(1, 2)  # the published [experts, in, out] orientation
            else:
                raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                                      f"{tuple(target.shape)} or its last two dims swapped")
        target.copy_(tensor.to(target.dtype))
        filled.add((layer, m[2]))
    for i, layer in enumerate(layers):
        if not layer.is_moe:
            continue
        for kind, pieces in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
            apart = [(piece, e) for piece in pieces for e in range(layer.mlp.num_experts)
                     if (i, piece, e) not in filled]
            if (i, kind) not in filled and apart:
                piece, e = apart[0]
                raise CheckpointError(f"checkpoint {model_dir} is missing tensor 'model.language_model.layers.{i}."
                                      + (f"mlp.experts.{kind}'" if len(apart) == len(pieces) * layer.mlp.num_experts
                                         else f"mlp.experts.{e}.{piece}.weight'"))


def _fill_expert(moe, name: str, expert: int, piece: str, tensor) -> None:
    """One expert's [out, in] projection into its rows of `w13` (gate, then up) or its `w2`."""
    inter = moe.w2.shape[2]
    if expert >= moe.num_experts:
        raise CheckpointError(f"tensor {name!r}: expert {expert} of {moe.num_experts}")
    target = {"gate_proj": moe.w13[expert, :inter], "up_proj": moe.w13[expert, inter:],
              "down_proj": moe.w2[expert]}[piece]
    if tuple(tensor.shape) != tuple(target.shape):
        raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
    target.copy_(tensor.to(target.dtype))
