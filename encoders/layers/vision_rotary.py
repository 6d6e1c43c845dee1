"""The 2-D rotary of a patch grid, as the Qwen-VL and GLM-4.1V towers use it.

Each patch has a row and a column; a quarter of the head's frequencies turn
with the row, a quarter with the column, and the two halves of the head repeat
them (`[rows * f, cols * f, rows * f, cols * f]`, rotate-half style). The
image processors emit patches in spatial-merge-block order (each
merge x merge group of patches together), so the rows and columns are listed
in that order too (`merge_block_positions`).
"""
from __future__ import annotations

import torch


def merge_block_positions(t: int, h: int, w: int, merge: int,
                          device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column [t * h * w] of every patch in the order the image processor
    emits them: (block_row, block_col, in_row, in_col), repeated for each temporal group."""
    rows = torch.arange(h, device=device).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
    cols = torch.arange(w, device=device).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
    rows = rows.permute(0, 2, 1, 3).reshape(-1).repeat(t)
    cols = cols.permute(0, 2, 1, 3).reshape(-1).repeat(t)
    return rows, cols


def rotary_inv_freq(head_dim: int, theta: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """[head_dim // 4] inverse frequencies, float32 (computed on the CPU, then moved:
    see engine/layers/rotary.py RotaryEmbedding)."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float, device="cpu") / half))
    return inv_freq.to(device)


def rotary_cos_sin(rows: torch.Tensor, cols: torch.Tensor,
                   inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [num_patches, head_dim], float32, for patches at (rows, cols)."""
    freqs = torch.cat([rows[:, None].float() * inv_freq, cols[:, None].float() * inv_freq], -1)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, H, D] turned by cos, sin [n, D] in float32, returned in x's dtype."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    xf = x.float()
    return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)
