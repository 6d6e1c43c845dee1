"""`LoRALinear`: a linear projection plus a low-rank delta per adapter slot, the one
wrapper of the language model (engine/lora/layers.py) and the vision tower
(encoders/tower_lora_layer.py). To the rows of each slot's adapter it adds

    delta = (x @ A[slot]^T) @ B[slot]^T * scaling[slot]

`pieces` are the output sizes of a fused projection in order (q, k, v; gate, up;
one piece for a plain one) and `names` their adapter module names. `A[slot]` stacks
the pieces' A matrices ([num_pieces * max_rank, in]); `B[slot]` is block-diagonal
([out, num_pieces * max_rank]: piece p's rows of the output only see piece p's rank
columns), so one pair of matmuls serves every piece; the zero rows and columns of a
piece the adapter does not target, or of a rank below `max_rank`, add exact zeros.

Which rows take which slot is the only difference between the two users, so it is
the `step`'s, shared by every wrapper of a model and entered around its forward: the
wrapper hands it the base output and the input (`step.add_deltas(layer, y, x)`).
The language model's step runs rows of many adapters in one forward (a gather or
Triton kernels: `LoRAStep`); the tower's runs one adapter on every row (two plain
matmuls: `TowerStep`, since the encoder groups images by adapter).
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class AdapterStep(Protocol):
    """Which rows of the forward in flight use which slot: the deltas added to `y`."""

    def add_deltas(self, layer: LoRALinear, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`y` [num_rows, out] (base(x)) plus `layer`'s deltas for x [num_rows, in]."""


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, names: tuple[str, ...], pieces: list[int], num_slots: int,
                 max_rank: int, step: AdapterStep):
        super().__init__()
        assert sum(pieces) == base.out_features and len(names) == len(pieces)
        self.base, self.names, self.pieces, self.max_rank, self.step = base, names, pieces, max_rank, step
        w = base.weight
        self.register_buffer("lora_a", torch.zeros(num_slots, len(pieces) * max_rank, base.in_features,
                                                   dtype=w.dtype, device=w.device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(num_slots, base.out_features, len(pieces) * max_rank,
                                                   dtype=w.dtype, device=w.device), persistent=False)
        self.is_set = [False] * num_slots  # whether the slot's adapter targets any piece here

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Writes an adapter into `slot`: `weights[name] = (A [r, in], B [out_piece, r])`
        for the pieces it targets; the others are zero."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        start = 0
        for p, (name, size) in enumerate(zip(self.names, self.pieces)):
            if name in weights:
                a, b = weights[name]
                r, col = a.shape[0], p * self.max_rank
                self.lora_a[slot, col:col + r] = a.to(self.lora_a.dtype)
                self.lora_b[slot, start:start + size, col:col + r] = b.to(self.lora_b.dtype)
            start += size
        self.is_set[slot] = any(name in weights for name in self.names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.step.add_deltas(self, self.base(x), x)  # [num_rows, out]
