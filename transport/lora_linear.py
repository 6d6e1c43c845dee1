"""The low-rank delta on one (fused) linear projection, for a batch of mixed adapters.

`LoRALinear` wraps an `nn.Linear` (one of the decoder's qkv_proj, o_proj,
gate_up_proj, down_proj: engine/lora/layers.py; or one of the vision tower's:
encoders/tower_lora.py) and adds, to the rows of each adapter's tokens,

    delta = (x @ A[slot]^T) @ B[slot]^T * scaling[slot]

`A[slot]` stacks the pieces' A matrices ([num_pieces * max_rank, in]);
`B[slot]` is block-diagonal ([out, num_pieces * max_rank]: piece p's rows of
the output only see piece p's rank columns), so one pair of matmuls serves
q, k and v (or gate and up) together; the zero rows and columns of a piece
the adapter does not target, or of a rank below `max_rank`, add exact zeros.

Which rows use which slot comes from the step (`LoRAStep`), entered by the
model runner (or the encoder) around the forward pass: a context manager
that refuses nesting, read by every wrapper (no global). Outside a step, or
for rows of no adapter, the wrapper is the plain projection. Wrap before
transport/cpu_linear.pack_linears: the wrapper reads the base weight's dtype
and device, and the packing then reaches the base inside it. Here because
encoders and engine may import only transport.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class SlotRows:
    """The rows of the step's flattened batch that run with adapter `slot`
    (`rows` None: every row)."""

    slot: int
    rows: torch.Tensor | None  # [num_rows] int64


class LoRAStep:
    """The adapter rows of the step in flight, shared by every `LoRALinear` of a model."""

    def __init__(self, num_slots: int):
        self.scaling = [0.0] * num_slots  # per slot: the resident adapter's scaling
        self.groups: tuple[SlotRows, ...] = ()
        self._active = False

    @contextlib.contextmanager
    def applied(self, groups: list[SlotRows]) -> Iterator[None]:
        """Runs the forward pass inside with these rows adapted; refuses nesting."""
        if self._active:
            raise RuntimeError("LoRAStep.applied does not nest: one forward pass at a time")
        self._active, self.groups = True, tuple(groups)
        try:
            yield
        finally:
            self._active, self.groups = False, ()


class LoRALinear(nn.Module):
    """`base` plus the step's adapters; `pieces` are the output sizes of the fused
    projections in order (e.g. [q, kv, kv]) and `names` their PEFT module names."""

    def __init__(self, base: nn.Linear, names: tuple[str, ...], pieces: list[int], num_slots: int,
                 max_rank: int, step: LoRAStep):
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
        y = self.base(x)  # [num_tokens, out]
        for group in self.step.groups:
            if not self.is_set[group.slot]:
                continue
            xs = x if group.rows is None else x[group.rows]
            delta = (xs @ self.lora_a[group.slot].t()) @ self.lora_b[group.slot].t() \
                * self.step.scaling[group.slot]  # [num_rows, out]
            if group.rows is None:
                y += delta
            else:
                y.index_add_(0, group.rows, delta)
        return y
