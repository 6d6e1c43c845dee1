"""The low-rank delta on one linear projection of the vision tower: `TowerLoRALinear`.

    y = base(x) + (x @ A[slot]^T) @ B[slot]^T * scaling[slot]      every row, one slot

A tower forward runs one adapter (or none) for all its rows (the encoder
groups images by adapter: encoders/tower_lora.py), so unlike the language
model's `LoRALinear` (engine/lora/layers.py: rows of many adapters in one
step, a gather or Triton kernels) the wrapper is two plain matmuls. `A[slot]`
is zero-padded to `max_rank` rows and `B[slot]` to as many columns: the padding
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


class TowerLoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, num_slots: int, max_rank: int, step: TowerStep):
        super().__init__()
        self.base, self.max_rank, self.step = base, max_rank, step
        w = base.weight
        self.register_buffer("lora_a", torch.zeros(num_slots, max_rank, base.in_features, dtype=w.dtype,
                                                   device=w.device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(num_slots, base.out_features, max_rank, dtype=w.dtype,
                                                   device=w.device), persistent=False)
        self.is_set = [False] * num_slots  # whether the slot's adapter adapts this projection

    def set_slot(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Writes an adapter's (A [r, in], B [out, r]) into `slot`; None: it leaves this projection alone."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if weights is not None:
            a, b = weights
            self.lora_a[slot, :a.shape[0]] = a.to(self.lora_a.dtype)
            self.lora_b[slot, :, :a.shape[0]] = b.to(self.lora_b.dtype)
        self.is_set[slot] = weights is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # [num_rows, out]
        slot = self.step.slot
        if slot is None or not self.is_set[slot]:
            return y
        return y + (x @ self.lora_a[slot].t()) @ self.lora_b[slot].t() * self.step.scaling[slot]


def wrap_tower(tower: nn.Module, num_slots: int, max_rank: int, step: TowerStep) -> dict[str, TowerLoRALinear]:
    """Every `nn.Linear` of the tower replaced in place by a `TowerLoRALinear`, by its path."""
    wrapped: dict[str, TowerLoRALinear] = {}
    for path, module in list(tower.named_modules()):
        if type(module) is not nn.Linear:
            continue
        parent_path, _, attr = path.rpartition(".")
        parent = tower.get_submodule(parent_path) if parent_path else tower
        wrapped[path] = TowerLoRALinear(module, num_slots, max_rank, step)
        setattr(parent, attr, wrapped[path])  # an nn.Sequential's "0" too (Qwen2.5-VL's merger.mlp)
    return wrapped
