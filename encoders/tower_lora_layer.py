"""The vision tower's adapter step, `TowerStep`, and `wrap_tower`: every linear
projection of the tower wrapped in the shared `LoRALinear`
(transport/weights/lora_linear.py, the language model's wrapper too), adding

    y = base(x) + (x @ A[slot]^T) @ B[slot]^T * scaling[slot]      every row, one slot

A tower forward runs one adapter (or none) for all its rows (the encoder
groups images by adapter: encoders/tower_lora.py), so unlike the language
model's `LoRAStep` (engine/lora/layers.py: rows of many adapters in one step, a
gather or Triton kernels) the step adds two plain matmuls. `A[slot]` is
zero-padded to `max_rank` rows and `B[slot]` to as many columns: the padding
adds exact zeros. The slot comes from `TowerStep.applied`, a context manager
entered around the forward that refuses nesting, shared by every wrapper of
the tower (no global). Wrap before transport/weights/cpu_linear.pack_linears: the
wrapper reads the base weight's dtype and device, and the packing then
reaches the base inside it.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from epd.transport.weights.lora_linear import LoRALinear


class TowerStep:
    """The slot the tower's forward in flight runs (None: the base tower), and each slot's scaling."""

    def __init__(self, num_slots: int):
        self.scaling = [0.0] * num_slots
        self.slot: int | None = None

    @contextlib.contextmanager
    def applied(self, slot: int) -> Iterator[None]:
        if self.slot is not None:
            raise RuntimeError("TowerStep.applied does not nest: one tower forward at a time")
        self.slot = slot
        try:
            yield
        finally:
            self.slot = None

    def add_deltas(self, layer: LoRALinear, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`y` [num_rows, out] plus the slot's delta on every row (y itself: no slot, or none here)."""
        slot = self.slot
        if slot is None or not layer.is_set[slot]:
            return y
        return y + (x @ layer.lora_a[slot].t()) @ layer.lora_b[slot].t() * self.scaling[slot]


def wrap_tower(tower: nn.Module, num_slots: int, max_rank: int, step: TowerStep) -> dict[str, LoRALinear]:
    """Every `nn.Linear` of the tower replaced in place by a `LoRALinear` of one piece named by
    its path (`set_slot(slot, {path: (A, B)})`), by its path."""
    wrapped: dict[str, LoRALinear] = {}
    for path, module in list(tower.named_modules()):
        if type(module) is not nn.Linear:
            continue
        parent_path, _, attr = path.rpartition(".")
        parent = tower.get_submodule(parent_path) if parent_path else tower
        wrapped[path] = LoRALinear(module, (path,), [module.out_features], num_slots, max_rank, step)
        setattr(parent, attr, wrapped[path])  # an nn.Sequential's "0" too (Qwen2.5-VL's merger.mlp)
    return wrapped
