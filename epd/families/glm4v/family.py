"""GLM-4.1V and GLM-4.5V: one vision tower and prompt format, one decoder with options, M-RoPE positions."""
from __future__ import annotations

from epd.families.glm4v.prompt_format import GLM4V_FORMAT
from epd.families.model_family import ModelFamily

TEXT_MODEL = "epd.families.glm4v.text_loader:load_text_model"
VISION = "epd.families.glm4v.vision:load_vision"


def glm4v_positions(hf_config):
    """Its 3-D rule: each image or video frame group on its merged grid (positions.py)."""
    from epd.families.glm4v.positions import positions

    return positions(hf_config)


# tool calls: vLLM's glm45 format (epd/api/tool_parsers/glm45.py)
FAMILIES = (
    ModelFamily("GLM-4.1V", "glm4v", "Glm4vForConditionalGeneration", GLM4V_FORMAT, TEXT_MODEL, VISION,
                glm4v_positions, tool_call_parser="glm45"),
    ModelFamily("GLM-4.5V", "glm4v_moe", "Glm4vMoeForConditionalGeneration", GLM4V_FORMAT, TEXT_MODEL, VISION,
                glm4v_positions, tool_call_parser="glm45"),
)
