"""The low-rank delta on one (fused) projection, for a batch of mixed adapters.

`LoRALinear` wraps one of the decoder's `nn.Linear`s (qkv_proj, o_proj,
gate_up_proj, down_proj) and adds, to the rows of each adapter's tokens,

    delta = (x @ A[slot]^T) @ B[slot]^T * scaling[slot]

`A[slot]` stacks the pieces' A matrices ([num_pieces * max_rank, in]);
`B[slot]` is block-diagonal ([out, num_pieces * max_rank]: piece p's rows of
the output only see piece p's rank columns), so one pair of matmuls serves
q, k and v (or gate and up) together; the zero rows and columns of a piece
the adapter does not target, or of a rank below `max_rank`, add exact zeros.

Which rows use which slot comes from the step (`LoRAStep`), entered by the
model runner around the forward pass: a context manager that refuses
nesting, read by every wrapper (no global). Outside a step, or for rows of
no adapter, the wrapper is the plain projection. Two paths, same sums: in
torch per slot a gather, two matmuls and an index_add (`add_lora_torch`,
the CPU path and the reference); on a GPU (the triton attention backend) two
Triton kernels over tiles of rows of one slot each (engine/lora/triton_lora.py,
vLLM's punica idea: shrink x @ A[slot]^T, then expand @ B[slot]^T into y).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from epd.engine.lora.step_rows import SlotRows, StepRows


def add_lora_torch(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                   groups: tuple[SlotRows, ...], scaling: list[float]) -> None:
    """The gathered low-rank matmul in torch (CPU; the Triton kernel's reference):
    y [num_tokens, out] += (x[rows] @ A[slot]^T) @ B[slot]^T * scaling[slot] per group,
    with x [num_tokens, in], lora_a [num_slots, R, in], lora_b [num_slots, out, R]."""
    for group in groups:
        xs = x if group.rows is None else x[group.rows]
        delta = (xs @ lora_a[group.slot].t()) @ lora_b[group.slot].t() * scaling[group.slot]  # [num_rows, out]
        if group.rows is None:
            y += delta
        else:
            y.index_add_(0, group.rows, delta)


class LoRAStep:
    """The adapter rows of the step in flight, shared by every `LoRALinear` of a model."""

    def __init__(self, num_slots: int):
        self.scaling = [0.0] * num_slots  # per slot: the resident adapter's scaling
        self.rows: StepRows | None = None
        self._active = False

    @contextlib.contextmanager
    def applied(self, rows: StepRows) -> Iterator[None]:
        """Runs the forward pass inside with these rows adapted; refuses nesting."""
        if self._active:
            raise RuntimeError("LoRAStep.applied does not nest: one forward pass at a time")
        self._active, self.rows = True, rows
        try:
            yield
        finally:
            self._active, self.rows = False, None


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
        rows = self.step.rows
        if rows is None or not any(self.is_set[slot] for slot in rows.slots):
            return y  # no step, or no adapter of the step targets this projection
        if rows.tiles is not None:
            from epd.engine.lora.triton_lora import add_lora

            add_lora(y, x, self.lora_a, self.lora_b, rows.tiles)
        else:
            add_lora_torch(y, x, self.lora_a, self.lora_b,
                           tuple(g for g in rows.groups if self.is_set[g.slot]), self.step.scaling)
        return y


def wrap_model(model: nn.Module, num_slots: int, max_rank: int, step: LoRAStep) -> list[tuple[int, LoRALinear]]:
    """Replaces the targeted projections of every decoder layer by `LoRALinear`s
    (a MoE layer's MLP keeps its experts as they are); returns (layer, wrapper) pairs."""
    cfg = model.cfg
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    wrapped = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        attn.qkv_proj = LoRALinear(attn.qkv_proj, ("q_proj", "k_proj", "v_proj"), [q, kv, kv],
                                   num_slots, max_rank, step)
        attn.o_proj = LoRALinear(attn.o_proj, ("o_proj",), [cfg.hidden_size], num_slots, max_rank, step)
        wrapped += [(i, attn.qkv_proj), (i, attn.o_proj)]
        if layer.is_moe:
            continue
        mlp = layer.mlp
        mlp.gate_up_proj = LoRALinear(mlp.gate_up_proj, ("gate_proj", "up_proj"), [cfg.intermediate_size] * 2,
                                      num_slots, max_rank, step)
        mlp.down_proj = LoRALinear(mlp.down_proj, ("down_proj",), [cfg.hidden_size], num_slots, max_rank, step)
        wrapped += [(i, mlp.gate_up_proj), (i, mlp.down_proj)]
    return wrapped
