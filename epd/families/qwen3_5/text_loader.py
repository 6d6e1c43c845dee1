"""Builds Qwen3.5's language model and fills it from the release's tensor names.

`model.language_model.*` is the text model, `lm_head.weight` its head (a tied or absent head
takes the embedding); `model.visual.*` is the vision tower's (not ours) and `mtp.*` the release's
multi-token-prediction layers, read only when speculation's method mtp asks (mtp.py). A full-attention layer's q_proj (query and
gate rows), k_proj and v_proj stack into one `qkv_proj`; gate/up projections (the dense MLP's,
the shared expert's) into `gate_up_proj`. MoE experts come one tensor each, as the release
and transformers' save have them (`mlp.experts.<e>.gate_proj.weight`, ...), or fused per layer
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`, either orientation); both stack into
the layer's `w13` / `w2`.
No transformers modeling code is used: only its config class.
"""
from __future__ import annotations

import re
from functools import partial
from pathlib import Path

import torch

from epd.families.qwen3_5.mtp import PREFIX as MTP_PREFIX, MTPHead, MTPShape, num_mtp_layers
from epd.families.qwen3_5.text_model import Qwen3_5ForCausalLM, TextConfig, rotary_embedding
from epd.families.qwen_vl.family import mrope_positions
from epd.transport.weights.checkpoint import CheckpointError, iter_tensors, load_weights, materialize

_TEXT_PREFIX = "model.language_model."
# fused per layer ("gate_up_proj", "down_proj") or one expert's ("0.gate_proj.weight", ...)
_EXPERTS = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj|(\d+)\.(gate_proj|up_proj|down_proj)\.weight)$")
_PIECES = re.compile(r"(layers\.\d+\.(?:self_attn|mlp|mlp\.shared_expert))\.(q_proj|k_proj|v_proj|gate_proj|up_proj)"
                     r"\.weight$")
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_ROUTER = re.compile(r"(layers\.\d+\.mlp)\.gate\.weight$")


def _text_rule(name: str, prefix: str = _TEXT_PREFIX, into: str = "model."):
    """Checkpoint name -> (our parameter, fused piece) for the tensors under `prefix`, ours under
    `into` (the text model's; the MTP layers': prefix "mtp.", into "")."""
    if name == "lm_head.weight":
        return ("lm_head.weight", None) if prefix == _TEXT_PREFIX else None
    if not name.startswith(prefix):
        return None  # model.visual.* (the vision side's), mtp.* (the MTP head's)
    rest = name[len(prefix):]
    if _EXPERTS.match(rest):
        return None  # filled by _load_experts
    if m := _ROUTER.match(rest):
        return f"{into}{m[1]}.experts.gate.weight", None
    if m := _PIECES.match(rest):
        fused, piece = _FUSED[m[2]]
        return f"{into}{m[1]}.{fused}.weight", piece
    return into + rest, None


def _describe(param: str, shard: int | None, prefix: str = _TEXT_PREFIX, into: str = "model.") -> str:
    """The checkpoint name expected for (our parameter, fused piece)."""
    if param == "lm_head.weight":
        return param
    name = prefix + param[len(into):].replace(".mlp.experts.gate.", ".mlp.gate.")
    if shard is None:
        return name
    fused = "qkv_proj" if ".qkv_proj." in name else "gate_up_proj"
    return name.replace(fused, next(p for p, (f, s) in _FUSED.items() if f == fused and s == shard))


def load_text_model(model_dir: str | Path, hf_config, dtype: torch.dtype,
                    device: str | torch.device = "cpu") -> Qwen3_5ForCausalLM:
    cfg = TextConfig.from_hf(hf_config)
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(cfg, mrope_positions(hf_config))
    model = materialize(model, device, dtype)
    model.model.rotary = rotary_embedding(cfg, device=device)  # float32 tables, not weights
    load_weights(model, model_dir, _text_rule, fused=_fused(cfg, model.model.layers, "model."),
                 fallbacks={"lm_head.weight": "model.embed_tokens.weight"}, describe=_describe)
    if cfg.num_experts:
        _load_experts(model, model_dir)
    model.load_mtp_head = partial(load_mtp_head, model)  # the `mtp.*` layers, read when speculation asks
    return model.eval()


def _fused(cfg: TextConfig, layers, into: str) -> dict[str, list[int]]:
    """Our stacked parameters (under `into`) -> the row sizes of their checkpoint pieces."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    fused = {}
    for i, layer in enumerate(layers):
        if not layer.is_linear:
            fused[f"{into}layers.{i}.self_attn.qkv_proj.weight"] = [2 * q, kv, kv]
        if layer.is_moe:
            fused[f"{into}layers.{i}.mlp.shared_expert.gate_up_proj.weight"] = [cfg.shared_expert_intermediate_size] * 2
        else:
            fused[f"{into}layers.{i}.mlp.gate_up_proj.weight"] = [cfg.intermediate_size] * 2
    return fused


def load_mtp_head(target: Qwen3_5ForCausalLM, model_dir: str | Path, hf_config, dtype: torch.dtype,
                  device: str | torch.device) -> tuple[MTPShape, MTPHead]:
    """The checkpoint's MTP layers (`mtp.*`, mtp.py) over `target`; ValueError naming what is
    missing or not served."""
    if num_mtp_layers(hf_config) not in (0, 1):
        raise ValueError(f"--speculative-config: method mtp serves one MTP layer; {model_dir} has "
                         f"mtp_num_hidden_layers={num_mtp_layers(hf_config)}")
    cfg = target.cfg
    with torch.device("meta"):
        head = MTPHead(cfg, target)
    head = materialize(head, device, dtype)
    head.rotary = rotary_embedding(cfg, device=device)  # float32 tables, not weights
    try:
        load_weights(head, model_dir, partial(_text_rule, prefix=MTP_PREFIX, into=""),
                     fused=_fused(cfg, head.layers, ""), describe=partial(_describe, prefix=MTP_PREFIX, into=""))
        if cfg.num_experts:
            _load_experts(target, model_dir, head.layers, MTP_PREFIX)
    except CheckpointError as exc:
        raise ValueError(f"--speculative-config: method mtp needs the checkpoint's MTP layers (mtp.* tensors): "
                         f"{exc}") from None
    return head.cfg, head.eval()


def _load_experts(model: Qwen3_5ForCausalLM, model_dir: str | Path, layers=None, prefix: str = _TEXT_PREFIX) -> None:
    """Fills every layer's `w13` [experts, 2 x inter, hidden] / `w2` [experts, hidden, inter]
    from per-expert or fused expert tensors; every expert's every piece must be there. `layers`
    under `prefix`: the text model's (default) or the MTP head's ("mtp.")."""
    layers = model.model.layers if layers is None else layers
    num_experts, inter = model.cfg.num_experts, model.cfg.moe_intermediate_size
    filled = set()

    def accept(name: str) -> bool:
        return name.startswith(prefix) and _EXPERTS.match(name[len(prefix):]) is not None

    for name, tensor in iter_tensors(model_dir, accept=accept):
        m = _EXPERTS.match(name[len(prefix):])
        layer = int(m[1])
        if layer >= len(layers):
            raise CheckpointError(f"tensor {name!r}: the model has {len(layers)} layers")
        experts = layers[layer].mlp.experts
        if m[3] is None:  # fused: every expert of the layer at once
            target = experts.w13 if m[2] == "gate_up_proj" else experts.w2
            if tuple(tensor.shape) != tuple(target.shape) and tensor.ndim == 3:
                tensor = tensor.transpose(1, 2)  # the published [experts, in, out] orientation
            keys = [(layer, e, piece) for e in range(num_experts)
                    for piece in (("gate_proj", "up_proj") if m[2] == "gate_up_proj" else ("down_proj",))]
        else:
            expert, piece = int(m[3]), m[4]
            if expert >= num_experts:
                raise CheckpointError(f"tensor {name!r}: the model has {num_experts} experts")
            target = {"gate_proj": experts.w13[expert, :inter], "up_proj": experts.w13[expert, inter:],
                      "down_proj": experts.w2[expert]}[piece]
            keys = [(layer, expert, piece)]
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        target.copy_(tensor.to(target.dtype))
        filled.update(keys)
    for i in range(len(layers)):
        for e in range(num_experts):
            for piece in ("gate_proj", "up_proj", "down_proj"):
                if (i, e, piece) not in filled:
                    raise CheckpointError(f"checkpoint {model_dir} is missing tensor "
                                          f"'{prefix}layers.{i}.mlp.experts.{e}.{piece}.weight'")
