"""Qwen's M-RoPE as a position rule (engine/models/positions.py's `PositionRule`): three rows, t, h, w."""
from __future__ import annotations

import math

import torch

from epd.families.qwen_vl.mrope import mrope_positions, positions_between


class MRopePositions:
    """M-RoPE (Qwen3-VL, Qwen2.5-VL): three rows, an image's tokens placed on its grid."""

    position_dims = 3

    def __init__(self, spatial_merge_size: int, tokens_per_second: float = 1.0):
        """`tokens_per_second`: the vision config's, spacing Qwen2.5-VL video positions."""
        self.spatial_merge_size = spatial_merge_size
        self.tokens_per_second = tokens_per_second

    def prompt_positions(self, num_tokens: int, spans=()) -> tuple[torch.Tensor, int]:
        """[3, num_tokens] positions of a prompt with image and video `spans`, and the delta of later tokens."""
        return mrope_positions(num_tokens, spans, self.spatial_merge_size, self.tokens_per_second)

    def between(self, prompt_positions: torch.Tensor, delta: int, num_prompt_tokens: int, start: int, end: int,
                device) -> torch.Tensor:
        """[3, end - start] positions of a request's tokens start..end."""
        return positions_between(prompt_positions, delta, num_prompt_tokens, start, end, device)

    def later(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [n] of tokens past a prompt (index + delta) -> [3, n], every row equal."""
        return positions.expand(3, -1)

    def check_spans(self, spans) -> None:
        """Each span's "grid_thw" is three positive ints whose merged grid has the span's
        length; "second_per_grid_t", when present, finite and positive; "first_group", when
        present, an int >= 1 continuing the span just before it."""
        end = None
        for span in spans:
            meta = span.meta
            grid = meta.get("grid_thw")
            m = self.spatial_merge_size
            if not (isinstance(grid, tuple) and len(grid) == 3 and all(type(x) is int and x > 0 for x in grid)
                    and grid[1] % m == 0 and grid[2] % m == 0
                    and grid[0] * (grid[1] // m) * (grid[2] // m) == span.length):
                raise ValueError(f"span at {span.offset}: grid_thw {grid!r:.40} does not give its {span.length} tokens")
            seconds = meta.get("second_per_grid_t")
            if seconds is not None and not (type(seconds) in (int, float) and math.isfinite(seconds) and seconds > 0):
                raise ValueError(f"span at {span.offset}: second_per_grid_t {seconds!r:.40} is not a positive number")
            first = meta.get("first_group")
            if first is not None and not (type(first) is int and first >= 1 and span.offset == end):
                raise ValueError(f"span at {span.offset}: first_group {first!r:.40} continues no span before it")
            end = span.end
