"""Qwen3-VL-MoE's text config on our decoder: Qwen3-VL with sparse MoE MLPs.

A layer is sparse unless listed in `mlp_only_layers`, and then only every
`decoder_sparse_step`-th one (transformers' rule). The router always
renormalises its top-k probabilities (the config has no `norm_topk_prob`;
one that says otherwise is followed). There is no shared expert in this
family. The vision tower is Qwen3-VL's, deepstack included.
"""
from __future__ import annotations

import dataclasses

from epd.engine.models.qwen3_vl import TextConfig


def text_config_from_hf(hf_config) -> TextConfig:
    tc = hf_config.text_config
    num_experts = int(getattr(tc, "num_experts", 0) or getattr(tc, "num_local_experts", 0) or 0)
    if num_experts <= 0:
        raise ValueError("a Qwen3-VL-MoE config without experts (num_experts = 0) is not supported")
    if getattr(tc, "shared_expert_intermediate_size", 0):
        raise ValueError("shared experts are not part of Qwen3-VL-MoE and are not supported")
    mlp_only = set(getattr(tc, "mlp_only_layers", None) or ())
    step = int(getattr(tc, "decoder_sparse_step", 1) or 1)
    moe_layers = tuple(i for i in range(tc.num_hidden_layers) if i not in mlp_only and (i + 1) % step == 0)
    norm = getattr(tc, "norm_topk_prob", True)
    return dataclasses.replace(
        TextConfig.from_hf(hf_config),
        moe_layer_ids=moe_layers, num_experts=num_experts, num_experts_per_tok=int(tc.num_experts_per_tok),
        moe_intermediate_size=int(tc.moe_intermediate_size),
        norm_topk_prob=norm if isinstance(norm, bool) else True,  # the class marks the field absent
    )
