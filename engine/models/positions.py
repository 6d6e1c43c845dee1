"""Where a model places each token for its rotary embedding (vLLM's `SupportsMRoPE`).

A model's `positions` says how many rows a positions tensor has
(`position_dims`: 1 for plain RoPE, 3 for M-RoPE's t, h, w) and gives a
prompt's positions with the delta for later tokens; the runner, CUDA graphs,
warm-up and the draft proposer ask it and never assume a row count. Tokens
past the prompt are text: token i sits at `i + delta` in every row.

    RopePositions   1 row: position = index, delta 0

A family with its own rule writes it in its package (Qwen's M-RoPE:
epd/families/qwen_vl/positions.py).
"""
from __future__ import annotations

from typing import Protocol

import torch


class PositionRule(Protocol):
    """What the engine asks a model about its positions."""

    position_dims: int  # rows of a positions tensor: 1 (RoPE) or 3 (M-RoPE)

    def prompt_positions(self, num_tokens: int, spans=()) -> tuple[torch.Tensor, int]:
        """[position_dims, num_tokens] positions of a prompt with its image and video
        `spans` (the wire's), and the delta: token i past the prompt sits at i + delta."""

    def between(self, prompt_positions: torch.Tensor, delta: int, num_prompt_tokens: int, start: int, end: int,
                device) -> torch.Tensor:
        """[position_dims, end - start] positions of a request's tokens start..end."""

    def later(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [n] of tokens past a prompt (index + delta) -> [position_dims, n]."""

    def check_spans(self, spans) -> None:
        """ValueError naming a span whose family metadata this rule cannot place (the
        wire checks the metadata's types only: its meaning is the family's)."""


class RopePositions:
    """Plain 1-D RoPE: token i sits at position i."""

    position_dims = 1

    def prompt_positions(self, num_tokens: int, spans=()) -> tuple[torch.Tensor, int]:
        """[1, num_tokens] positions of a prompt, and the delta of later tokens (0)."""
        return torch.arange(num_tokens).unsqueeze(0), 0

    def between(self, prompt_positions: torch.Tensor, delta: int, num_prompt_tokens: int, start: int, end: int,
                device) -> torch.Tensor:
        """[1, end - start] positions of a request's tokens start..end."""
        return torch.arange(start + delta, end + delta, device=device).unsqueeze(0)

    def later(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [n] of tokens past a prompt (index + delta) -> [1, n]."""
        return positions.unsqueeze(0)

    def check_spans(self, spans) -> None:
        """Nothing to check: an item's tokens sit at their indices whatever its metadata."""
