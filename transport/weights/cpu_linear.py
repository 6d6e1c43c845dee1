"""Linear layers on the CPU through oneDNN with pre-packed weights.

torch's CPU `F.linear` in float32 goes to the BLAS it was built with: MKL in
the x86 wheels. On AMD CPUs MKL takes a generic path, and on this project's
machines (AMD EPYC, AVX2) it ran the small-batch projections of a decode step
2.5-4x slower per thread than oneDNN with the weight packed once into its own
blocked layout (one thread, M = 8..128 rows: docs/benchmarks_archive.md, "Where the
served gap to vLLM came from"). vLLM's CPU backend makes the same choice
(`dispatch_cpu_unquantized_gemm`: oneDNN with a prepared weight). The results
differ from MKL's only in rounding (~1e-6 relative): the order of the sums,
as between any two GEMM libraries.

`pack_linears(module)` swaps every float32 `nn.Linear` of a loaded module for
a `PackedLinear` holding only the packed weight (the plain copy is released:
keeping both would double the weights' memory). It is called by both loaders
(engine: language model; encoders: vision tower) after the weights are in and
before the module runs; it changes nothing on other devices, for other dtypes,
or where torch has no oneDNN. Shared here because encoders and engine may
import only transport.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PACKED_DTYPES = (torch.float32,)  # bfloat16 packs too, but was not measured faster on AVX2


def can_pack(linear: nn.Linear) -> bool:
    w = linear.weight
    return (w.device.type == "cpu" and w.dtype in PACKED_DTYPES and not w.is_meta
            and torch.backends.mkldnn.is_available())


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward over a oneDNN-packed weight (inference only)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            # None: no batch size to specialise the layout for (decode and prefill differ)
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def add(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """`forward(x) + other` (other: the output's shape), the sum a post-op of the
        same oneDNN call: no second pass over the output (a residual add)."""
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.packed, self.bias, "add")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PackedSwiGLU(nn.Module):
    """`silu(gate(x)) * up(x)` from a fused gate/up `nn.Linear` (weight [2 * size, in]:
    gate rows, then up rows), in two oneDNN calls with the activation and the product
    as their post-ops: no [rows, 2 * size] intermediate, no elementwise passes."""

    def __init__(self, gate_up: nn.Linear, size: int):
        super().__init__()
        assert gate_up.out_features == 2 * size and gate_up.bias is None, (gate_up.out_features, size)
        self.in_features, self.size = gate_up.in_features, size
        w = gate_up.weight.detach()
        with torch.no_grad():
            self.gate = torch.ops.mkldnn._reorder_linear_weight(w[:size].contiguous(), None)
            self.up = torch.ops.mkldnn._reorder_linear_weight(w[size:].contiguous(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] -> [rows, size]."""
        gate = torch.ops.mkldnn._linear_pointwise(x, self.gate, None, "swish", [], "")  # silu(x W_gate^T)
        return torch.ops.mkldnn._linear_pointwise.binary(x, gate, self.up, None, "mul")  # (x W_up^T) * gate

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, size={self.size}"


def linear_add(linear: nn.Module, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """`other + linear(x)`: one oneDNN call where `linear` is packed, else the plain sum."""
    if type(linear) is PackedLinear:
        return linear.add(x, other)
    return other + linear(x)


def swiglu(gate_up: nn.Module, x: torch.Tensor, size: int) -> torch.Tensor:
    """`silu(gate) * up` of a fused gate/up projection: [rows, in] -> [rows, size];
    the reference computation unless `gate_up` is a `PackedSwiGLU`."""
    if type(gate_up) is PackedSwiGLU:
        return gate_up(x)
    gate, up = gate_up(x).split(size, dim=-1)
    return F.silu(gate) * up


def pack_swiglu(module: nn.Module, name: str, size: int) -> bool:
    """Replaces `module.<name>`, a fused gate/up `nn.Linear`, by a `PackedSwiGLU` where
    it can be packed (before `pack_linears`, which would pack it whole); returns whether."""
    child = getattr(module, name)
    if type(child) is not nn.Linear or not can_pack(child) or child.bias is not None:
        return False
    setattr(module, name, PackedSwiGLU(child, size))
    return True


def pack_linears(module: nn.Module) -> int:
    """Replaces every packable `nn.Linear` under `module` in place; returns how many."""
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and can_pack(child):
                setattr(parent, name, PackedLinear(child))
                count += 1
    return count
