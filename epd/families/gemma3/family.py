"""Gemma 3: a Gemma 3 decoder (sliding and global layers) behind a SigLIP tower, plain 1-D RoPE."""
from __future__ import annotations

from epd.families.gemma3.prompt_format import GEMMA3_FORMAT
from epd.families.model_family import ModelFamily


def rope_positions(hf_config):
    """Plain RoPE: token i sits at position i, images included."""
    from epd.engine.models.positions import RopePositions

    return RopePositions()


FAMILIES = (
    ModelFamily("Gemma 3", "gemma3", "Gemma3ForConditionalGeneration", GEMMA3_FORMAT,
                "epd.families.gemma3.text_loader:load_text_model", "epd.families.gemma3.vision:load_vision",
                rope_positions, tool_call_parser="pythonic"),  # vLLM's, with its Gemma 3 tool template
)
