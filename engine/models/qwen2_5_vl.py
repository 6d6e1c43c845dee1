"""Qwen2.5-VL's text config on our decoder: a Qwen2 decoder (q/k/v biases, no
q/k norm, head_dim = hidden / heads) with contiguous M-RoPE sections
(t, h, w blocks of frequencies, not interleaved) and no deepstack. Its vision
tower lives in encoders/qwen2_5_vision_tower.py.
"""
from __future__ import annotations

import dataclasses

from epd.engine.models.qwen3_vl import TextConfig


def text_config_from_hf(hf_config) -> TextConfig:
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
