"""InternVL (InternVL3.5 and InternVL3): InternViT tiles over a Qwen3, Qwen3-MoE or Qwen2 language model,
1-D RoPE, the InternVL prompt format."""
from __future__ import annotations

from epd.families.internvl.prompt_format import INTERNVL_FORMAT
from epd.families.model_family import ModelFamily


def rope_positions(hf_config):
    """Plain 1-D RoPE: token i at position i, image tokens included."""
    from epd.engine.models.positions import RopePositions

    return RopePositions()


# tool calls: its language model's (Qwen3, Qwen2) <tool_call> JSON blocks, vLLM's hermes; vLLM has no
# InternVL parser, and a template without tools needs --chat-template (docs/decisions/internvl-family.md)
FAMILIES = (
    ModelFamily("InternVL", "internvl", "InternVLForConditionalGeneration", INTERNVL_FORMAT,
                "epd.families.internvl.text_loader:load_text_model", "epd.families.internvl.vision:load_vision",
                rope_positions, tool_call_parser="hermes"),
)
