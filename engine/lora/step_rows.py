"""Which rows of an engine step run with which adapter slot, in the two shapes the
gathered low-rank matmul takes them: per slot a tensor of rows (`SlotRows`, the
torch path) or tiles of BLOCK_M rows of one slot each (`SlotTiles`, the Triton
kernels). Built once a step by `step_rows` (LoRAManager.rows) from each token's
slot and read by every `LoRALinear` of the model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_M = 16  # rows per tile of the Triton kernel (engine/lora/triton_lora.py): tl.dot's least


@dataclass(frozen=True)
class SlotRows:
    """The rows of the step's flattened batch that run with adapter `slot`
    (`rows` None: every row)."""

    slot: int
    rows: torch.Tensor | None  # [num_rows] int64


@dataclass(frozen=True)
class SlotTiles:
    """The same rows for the Triton kernel: sorted by slot, each slot's run padded to
    whole tiles of BLOCK_M rows, so every tile belongs to one slot."""

    rows: torch.Tensor  # [num_tiles * BLOCK_M] int64: a row of the flattened batch, -1 padding
    tile_slots: torch.Tensor  # [num_tiles] int64
    tile_scaling: torch.Tensor  # [num_tiles] float32: the tile's adapter's scaling


@dataclass(frozen=True)
class StepRows:
    """Which rows of a step run with which slot: `groups` (the torch path) or `tiles`
    (the Triton kernel, GPU), and the slots in use."""

    slots: frozenset[int]
    groups: tuple[SlotRows, ...] = ()
    tiles: SlotTiles | None = None


def step_rows(token_slots: list[int], scaling: list[float], device: torch.device, use_triton: bool) -> StepRows:
    """Per token of the step its slot (-1: no adapter) -> its rows per slot."""
    by_slot: dict[int, list[int]] = {}
    for row, slot in enumerate(token_slots):
        if slot >= 0:
            by_slot.setdefault(slot, []).append(row)
    slots = frozenset(by_slot)
    if use_triton:
        rows, tile_slots = [], []
        for slot, slot_rows in by_slot.items():
            num_tiles = -(-len(slot_rows) // BLOCK_M)
            rows += slot_rows + [-1] * (num_tiles * BLOCK_M - len(slot_rows))
            tile_slots += [slot] * num_tiles
        return StepRows(slots, tiles=SlotTiles(
            torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(tile_slots, dtype=torch.long, device=device),
            torch.tensor([scaling[s] for s in tile_slots], dtype=torch.float32, device=device)))
    if len(by_slot) == 1 and len(next(iter(by_slot.values()))) == len(token_slots):
        return StepRows(slots, (SlotRows(next(iter(by_slot)), None),))  # every row, one adapter: no gather
    return StepRows(slots, tuple(SlotRows(slot, torch.tensor(rows, dtype=torch.long, device=device))
                                 for slot, rows in by_slot.items()))
