"""Qwen2.5-Omni (the thinker: text out): a whole Omni checkpoint or a thinker-only one (torch-free)."""
from __future__ import annotations

from epd.families.model_family import ModelFamily
from epd.families.qwen_omni.prompt_format import QWEN_OMNI_FORMAT
from epd.families.qwen_omni.thinker_config import thinker_config

TEXT_MODEL = "epd.families.qwen_omni.text_loader:load_text_model"
VISION = "epd.families.qwen_omni.vision:load_vision"
AUDIO = "epd.families.qwen_omni.audio:load_audio"


def tmrope_positions(hf_config):
    """Its TMRoPE rule: images on their merged grid, audio like text (positions.py)."""
    from epd.families.qwen_omni.positions import OmniPositions

    thinker = thinker_config(hf_config)
    return OmniPositions(thinker.vision_config.spatial_merge_size, float(thinker.position_id_per_seconds))


FAMILIES = (
    ModelFamily("Qwen2.5-Omni", "qwen2_5_omni", "Qwen2_5OmniForConditionalGeneration", QWEN_OMNI_FORMAT, TEXT_MODEL,
                VISION, tmrope_positions, tool_call_parser="hermes", audio=AUDIO, served_config=thinker_config),
    ModelFamily("Qwen2.5-Omni thinker", "qwen2_5_omni_thinker", "Qwen2_5OmniThinkerForConditionalGeneration",
                QWEN_OMNI_FORMAT, TEXT_MODEL, VISION, tmrope_positions, tool_call_parser="hermes", audio=AUDIO),
)
