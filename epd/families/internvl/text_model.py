"""InternVL's language model: a plain Qwen3 (dense) or Qwen3-MoE decoder, or
Qwen2 (q/k/v biases, no q/k norm) for InternVL3, with 1-D RoPE.

It is the Qwen decoder of epd/families/qwen_vl/text_model.py over the shared layers,
configured by `text_config`: every rotary frequency on the one position row
(`mrope_section` (head_dim / 2, 0, 0), contiguous), and positions by
`RopePositions` (token i at i; models/positions.py), so the rotary layer
rotates by that row as plain RoPE. The image tokens' embeddings replace the
placeholders' (`ForwardBatch.mm_embeds`); there are no extras.
"""
from __future__ import annotations

import dataclasses

from epd.engine.models.positions import RopePositions
from epd.families.qwen_vl.text_model import Qwen3VLForCausalLM, TextConfig

TEXT_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen2")


def text_config(hf_config) -> TextConfig:
    """The InternVL config's text model on our decoder's `TextConfig`; ValueError naming what we cannot serve."""
    tc = hf_config.text_config
    model_type = getattr(tc, "model_type", None)
    if model_type not in TEXT_MODEL_TYPES:
        raise ValueError(f"InternVL with a {model_type!r} language model is not supported "
                         f"(supported: {', '.join(TEXT_MODEL_TYPES)})")
    if getattr(tc, "use_sliding_window", False):
        raise ValueError("InternVL's language model with use_sliding_window is not supported")
    rope = dict(getattr(tc, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type {rope.get('rope_type')!r} of the language model is not supported")
    if model_type == "qwen3_moe":
        from epd.families.qwen_vl.text_configs import qwen3_vl_moe_config

        cfg = qwen3_vl_moe_config(hf_config)
    else:
        cfg = TextConfig.from_hf(hf_config)
    if model_type == "qwen2":  # q/k/v biases, no q/k norm
        cfg = dataclasses.replace(cfg, attention_bias=True, qk_norm=False)
    elif getattr(tc, "attention_bias", False):  # Qwen3's would bias o_proj too, which our attention has not
        raise ValueError("a Qwen3 language model with attention_bias is not supported")
    return dataclasses.replace(cfg, mrope_section=(cfg.head_dim // 2, 0, 0), mrope_interleaved=False)


def build_text_model(cfg: TextConfig) -> Qwen3VLForCausalLM:
    """The decoder and head, unfilled (build it under torch.device("meta") for loading)."""
    return Qwen3VLForCausalLM(cfg, RopePositions())
