"""The language model's projections wrapped for LoRA: `wrap_model`.

Each of the decoder's qkv_proj, o_proj, gate_up_proj and down_proj becomes a
`LoRALinear` (transport/lora_linear.py: the low-rank delta for a batch of
mixed adapters, and the `LoRAStep` the runner enters around the forward).
"""
from __future__ import annotations

from torch import nn

from epd.transport.lora_linear import LoRALinear, LoRAStep, SlotRows

__all__ = ["LoRALinear", "LoRAStep", "SlotRows", "wrap_model"]


def wrap_model(model: nn.Module, num_slots: int, max_rank: int, step: LoRAStep) -> list[tuple[int, LoRALinear]]:
    """Replaces the targeted projections of every decoder layer by `LoRALinear`s
    (a MoE layer's MLP keeps its experts as they are); returns (layer, wrapper) pairs."""
    cfg = model.cfg
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    wrapped = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        attn.qkv_proj = LoRALinear(attn.qkv_proj, ("q_proj", "k_proj", "v_proj"), [q, kv, kv],
                                   num_slots, max_rank, step)
        attn.o_proj = LoRALinear(attn.o_proj, ("o_proj",), [cfg.hidden_size], num_slots, max_rank, step)
        wrapped += [(i, attn.qkv_proj), (i, attn.o_proj)]
        if layer.is_moe:
            continue
        mlp = layer.mlp
        mlp.gate_up_proj = LoRALinear(mlp.gate_up_proj, ("gate_proj", "up_proj"), [cfg.intermediate_size] * 2,
                                      num_slots, max_rank, step)
        mlp.down_proj = LoRALinear(mlp.down_proj, ("down_proj",), [cfg.hidden_size], num_slots, max_rank, step)
        wrapped += [(i, mlp.gate_up_proj), (i, mlp.down_proj)]
    return wrapped
