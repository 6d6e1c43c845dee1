"""Qwen3.5 and Qwen3.5-MoE: Qwen3-VL's prompt format, positions and tower over a hybrid decoder;
tool calls in vLLM's qwen3_coder format (epd/api/tool_parsers/qwen3_coder.py)."""
from __future__ import annotations

from epd.families.model_family import ModelFamily
from epd.families.qwen_vl.family import VISION, mrope_positions
from epd.families.qwen_vl.prompt_format import QWEN_VL_FORMAT

TEXT_MODEL = "epd.families.qwen3_5.text_loader:load_text_model"

FAMILIES = (
    ModelFamily("Qwen3.5", "qwen3_5", "Qwen3_5ForConditionalGeneration", QWEN_VL_FORMAT, TEXT_MODEL, VISION,
                mrope_positions, tool_call_parser="qwen3_coder"),
    ModelFamily("Qwen3.5-MoE", "qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", QWEN_VL_FORMAT, TEXT_MODEL,
                VISION, mrope_positions, tool_call_parser="qwen3_coder"),
)
