"""Each Qwen family's Hugging Face text config -> our decoder's `TextConfig` (text_model.py).

Qwen3-VL's maps field for field (`TextConfig.from_hf`). Qwen3-VL-MoE is
Qwen3-VL with sparse MoE MLPs: a layer is sparse unless listed in
`mlp_only_layers`, and then only every `decoder_sparse_step`-th one
(transformers' rule); the router always renormalises its top-k probabilities
(the config has no `norm_topk_prob`; one that says otherwise is followed);
there is no shared expert. Qwen2.5-VL is a Qwen2 decoder (q/k/v biases, no q/k
norm, head_dim = hidden / heads) with contiguous M-RoPE sections (t, h, w
blocks of frequencies, not interleaved) and no deepstack.
"""
from __future__ import annotations

import dataclasses

from epd.families.qwen_vl.text_model import TextConfig


def qwen3_vl_moe_config(hf_config) -> TextConfig:
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


def qwen2_5_vl_config(hf_config) -> TextConfig:
    tc = hf_config.text_config
    if getattr(tc, "use_sliding_window", False):
        raise ValueError("Qwen2.5-VL with use_sliding_window=true is not supported")
    rope = dict(getattr(tc, "rope_parameters", None) or {})
    rope.update(getattr(tc, "rope_scaling", None) or {})
    section = tuple(rope.get("mrope_section", (16, 24, 24)))
    head_dim = tc.hidden_size // tc.num_attention_heads
    if 2 * sum(section) != head_dim:
        raise ValueError(f"mrope_section {list(section)} does not cover head_dim {head_dim}")
    return dataclasses.replace(
        TextConfig.from_hf(hf_config), head_dim=head_dim, mrope_section=section, mrope_interleaved=False,
        rope_theta=float(rope.get("rope_theta", getattr(tc, "rope_theta", 1_000_000.0))),
        attention_bias=True, qk_norm=False,
    )


def text_config(hf_config) -> TextConfig:
    """The decoder config of any Qwen family's checkpoint."""
    if hf_config.model_type == "qwen3_vl_moe":
        return qwen3_vl_moe_config(hf_config)
    if hf_config.model_type == "qwen2_5_vl":
        return qwen2_5_vl_config(hf_config)
    return TextConfig.from_hf(hf_config)
