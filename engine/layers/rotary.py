"""Rotary position embedding for 1 or 3 position rows.

With three rows (time, height, width) each frequency is rotated by one row,
chosen by `sections` (how many frequencies each row drives), laid out either
interleaved t,h,w,t,h,w,... (Qwen3-VL) or contiguous (Qwen2-VL style); the
model passes its own sections (engine/models/). Given one row of positions it
is plain RoPE (every frequency by that row), which is the three-row result
where the rows are equal (text). Without sections it is plain 1-D RoPE only,
with its own base and scaling: a model whose layers rotate with different
bases (Gemma 3: local layers 10,000, global ones `rope_theta` scaled
"linear") holds one per kind, built from transformers' `rope_parameters`
(`from_rope_parameters`).

`rotary_dim` (default: the whole head) is how many leading dims of a head
rotate (GLM's `partial_rotary_factor`); the rest pass through. Two layouts
of the rotated dims: halves (`apply_rotary`: dim j pairs with j + D/2, as
Qwen and most models) or adjacent pairs (`apply_rotary_pairs`: 2j with
2j + 1, as GLM-4.1V); the attention layer picks one (layers/attention.py).
"""
from __future__ import annotations

import torch


class RotaryEmbedding:
    """Not an nn.Module: its float32 tables must not follow the model's dtype."""

    def __init__(self, head_dim: int, rope_theta: float, sections: tuple[int, int, int] | None = None,
                 interleaved: bool = False, device: str | torch.device = "cpu", factor: float = 1.0,
                 rotary_dim: int | None = None):
        """`sections`: frequencies each of three position rows drives (None: one row only);
        `factor`: transformers' "linear" scaling (the frequencies divided by it; 1: "default");
        `rotary_dim`: the leading dims of a head that rotate (None: all of them)."""
        dim = rotary_dim or head_dim
        # computed on the CPU, then placed: on "meta" (a model being built for loading) an op like
        # arange runs torch's reference op, whose first use imports torch._dynamo (seconds of start-up)
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))
        if factor != 1.0:
            inv_freq /= factor  # transformers' order: the float32 frequencies, then divided
        self.inv_freq = inv_freq.to(device)
        self.axis = None if sections is None else self._axis(dim // 2, sections, interleaved).to(device)

    @classmethod
    def from_rope_parameters(cls, head_dim: int, params: dict, device: str | torch.device = "cpu") -> RotaryEmbedding:
        """Plain 1-D RoPE from one of transformers' `rope_parameters` dicts ({"rope_type": "default"
        or "linear", "rope_theta": base, "factor": ...}); ValueError for another type."""
        rope_type = params.get("rope_type", "default")
        if rope_type not in ("default", "linear"):
            raise ValueError(f"rope_type {rope_type!r} is not supported (supported: default, linear)")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial_rotary_factor is not supported")
        factor = float(params["factor"]) if rope_type == "linear" else 1.0
        return cls(head_dim, float(params["rope_theta"]), device=device, factor=factor)

    @staticmethod
    def _axis(half: int, sections: tuple[int, int, int], interleaved: bool) -> torch.Tensor:
        axis = torch.zeros(half, dtype=torch.long, device="cpu")  # which position row drives frequency j
        sec = sections
        if interleaved:
            axis[1:sec[1] * 3:3] = 1
            axis[2:sec[2] * 3:3] = 2
        else:  # contiguous sections (Qwen2-VL style)
            axis[sec[0]:sec[0] + sec[1]] = 1
            axis[sec[0] + sec[1]:] = 2
        return axis

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3 or 1, num_tokens] -> cos, sin [num_tokens, 1, rotary_dim / 2] (float32): one half
        of transformers' tables, whose two halves are equal; `apply_rotary` takes them."""
        if positions.shape[0] == 1:  # plain RoPE: the one row drives every frequency
            pos = positions.expand(self.inv_freq.shape[0], -1)  # [half, N]
        elif self.axis is None:
            raise ValueError(f"plain RoPE takes one position row, got {positions.shape[0]}")
        else:
            pos = positions.gather(0, self.axis[:, None].expand(-1, positions.shape[1]))  # [half, N]
        freqs = (pos.t().float() * self.inv_freq)[:, None, :]  # [N, 1, half]
        return freqs.cos(), freqs.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half: [..., D] -> cat(-x2, x1), x1 and x2 its halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] rotated by half-split RoPE with cos, sin [N, 1, D / 2]: transformers'
    `x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)`, the same products and sums per
    element, without the rotated copy of x or the doubled tables."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rotary_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] rotated by RoPE on adjacent pairs (GPT-J, GLM-4.1V): dims 2j and 2j + 1 by
    frequency j, cos, sin [N, 1, D / 2]. transformers' `x * cos2 + rotate_half_llm(x) * sin2`
    (cos2, sin2: each frequency repeated twice), the same products and sums per element."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
