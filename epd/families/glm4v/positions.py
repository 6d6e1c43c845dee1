"""GLM-4.1V's 3-D positions (transformers' Glm4vModel.get_rope_index) as a position rule.

Text advances the t, h and w rows together. An image of merged grid (1, h, w)
placed at running position p takes t-row p, h-row p + row, w-row p + col, and
the text after it resumes at p + max(h, w). A video is written as one image
per frame group (`<|begin_of_image|>` placeholders `<|end_of_image|>` then the
group's timestamp as text), and get_rope_index splits its grid (t, h, w) into
t grids (1, h, w): each group is placed like an image, at the running position
where it stands. That is M-RoPE's rule over one (1, h, w) span per image or
frame group (epd/families/qwen_vl/mrope.py, as Qwen3-VL's video groups), which this
rule reuses; GLM's spans carry "grid_thw" only, so the Qwen-only metadata
("second_per_grid_t", "first_group") is refused at the engine's door.
"""
from __future__ import annotations

from epd.families.qwen_vl.positions import MRopePositions

# span metadata M-RoPE reads that GLM-4.1V never sends
_QWEN_ONLY = ("second_per_grid_t", "first_group")


class Glm4vPositions(MRopePositions):
    """Three rows, each image or video frame group placed on its merged grid."""

    def __init__(self, spatial_merge_size: int):
        super().__init__(spatial_merge_size)

    def check_spans(self, spans) -> None:
        """Each span's "grid_thw" is (1, h, w) giving its length (one image or one frame
        group), and it carries no other metadata M-RoPE would read."""
        for span in spans:
            extra = [key for key in _QWEN_ONLY if key in span.meta]
            if extra:
                raise ValueError(f"span at {span.offset}: GLM-4.1V places no {extra[0]!r}")
            grid = span.meta.get("grid_thw")
            if isinstance(grid, tuple) and len(grid) == 3 and grid[0] != 1:
                raise ValueError(f"span at {span.offset}: grid_thw {grid!r:.40} is not one image or frame group")
        super().check_spans(spans)


def positions(hf_config) -> Glm4vPositions:
    """The rule for a transformers Glm4vConfig (or Glm4vMoeConfig)."""
    return Glm4vPositions(hf_config.vision_config.spatial_merge_size)
