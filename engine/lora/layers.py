"""The low-rank delta on the decoder's (fused) projections, for a batch of mixed adapters.

`wrap_model` wraps each of the decoder's `nn.Linear`s (qkv_proj, o_proj,
gate_up_proj, down_proj; a Gated DeltaNet layer's in_proj_qkv, in_proj_z, in_proj_b,
in_proj_a and out_proj in place of the attention's; a MoE layer's shared expert, not its routed
experts) in a `LoRALinear` (transport/weights/lora_linear.py:
the slots' A and B, one pair of matmuls for q, k and v or gate and up), which
adds to the rows of each adapter's tokens

    delta = (x @ A[slot]^T) @ B[slot]^T * scaling[slot]

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

from epd.engine.lora.adapter import LINEAR_ATTENTION_MODULES, ProjectionShapes
from epd.engine.lora.step_rows import SlotRows, StepRows
from epd.transport.weights.lora_linear import LoRALinear


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
    """The adapter rows of the step in flight, shared by every `LoRALinear` of a model:
    rows of many adapters in one forward."""

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

    def add_deltas(self, layer: LoRALinear, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`y` plus `layer`'s deltas for the rows of each slot of the step (in place)."""
        rows = self.rows
        if rows is None or not any(layer.is_set[slot] for slot in rows.slots):
            return y  # no step, or no adapter of the step targets this projection
        if rows.tiles is not None:
            from epd.engine.lora.triton_lora import add_lora

            add_lora(y, x, layer.lora_a, layer.lora_b, rows.tiles)
        else:
            add_lora_torch(y, x, layer.lora_a, layer.lora_b,
                           tuple(g for g in rows.groups if layer.is_set[g.slot]), self.scaling)
        return y


def wrap_model(model: nn.Module, num_slots: int, max_rank: int, step: LoRAStep) -> list[tuple[int, LoRALinear]]:
    """Replaces the targeted projections of every decoder layer by `LoRALinear`s
    (a MoE layer's MLP keeps its experts as they are); returns (layer, wrapper) pairs."""
    sizes = ProjectionShapes.of(model.cfg).sizes

    def wrap(owner: nn.Module, attr: str, names: tuple[str, ...]) -> LoRALinear:
        wrapper = LoRALinear(getattr(owner, attr), names, [sizes[n][1] for n in names], num_slots, max_rank, step)
        setattr(owner, attr, wrapper)
        return wrapper

    wrapped = []
    for i, layer in enumerate(model.model.layers):
        if getattr(layer, "is_linear", False):  # a Gated DeltaNet layer: its own projections, one by one
            wrapped += [(i, wrap(layer.linear_attn, name, (name,))) for name in LINEAR_ATTENTION_MODULES]
        else:
            wrapped += [(i, wrap(layer.self_attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"))),
                        (i, wrap(layer.self_attn, "o_proj", ("o_proj",)))]
        if layer.is_moe:  # the routed experts as they are; a shared expert (Qwen3.5-MoE) is a dense MLP
            shared = getattr(layer.mlp, "shared_expert", None)
            if shared is not None:
                wrapped += [(i, wrap(shared, "gate_up_proj", ("shared_expert.gate_proj", "shared_expert.up_proj"))),
                            (i, wrap(shared, "down_proj", ("shared_expert.down_proj",)))]
            continue
        wrapped += [(i, wrap(layer.mlp, "gate_up_proj", ("gate_proj", "up_proj"))),
                    (i, wrap(layer.mlp, "down_proj", ("down_proj",)))]
    return wrapped
