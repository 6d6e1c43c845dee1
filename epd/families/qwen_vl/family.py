"""Qwen3-VL, Qwen3-VL-MoE and Qwen2.5-VL: one decoder with knobs, M-RoPE, the Qwen-VL prompt format."""
from __future__ import annotations

from epd.families.model_family import ModelFamily
from epd.families.qwen_vl.prompt_format import QWEN_VL_FORMAT

TEXT_MODEL = "epd.families.qwen_vl.text_loader:load_text_model"
VISION = "epd.families.qwen_vl.vision:load_vision"
TEXT_SHARD = "epd.families.qwen_vl.text_loader:load_text_shard"


def mrope_positions(hf_config):
    """Its M-RoPE rule: images on their merged grid, Qwen2.5-VL videos spaced by `tokens_per_second`."""
    from epd.families.qwen_vl.positions import MRopePositions

    vision = hf_config.vision_config
    return MRopePositions(vision.spatial_merge_size, float(getattr(vision, "tokens_per_second", None) or 1.0))


FAMILIES = (
    ModelFamily("Qwen3-VL", "qwen3_vl", "Qwen3VLForConditionalGeneration", QWEN_VL_FORMAT, TEXT_MODEL, VISION,
                mrope_positions, tool_call_parser="hermes", tower_lora=True, text_shard=TEXT_SHARD),
    ModelFamily("Qwen3-VL-MoE", "qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", QWEN_VL_FORMAT, TEXT_MODEL,
                VISION, mrope_positions, tool_call_parser="hermes", tower_lora=True),
    ModelFamily("Qwen2.5-VL", "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", QWEN_VL_FORMAT, TEXT_MODEL,
                VISION, mrope_positions, tool_call_parser="hermes", tower_lora=True, text_shard=TEXT_SHARD),
)
