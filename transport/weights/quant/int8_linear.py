"""INT8 W8A8 on the CPU: int8 weights per output channel, activations quantized per token
at run time, the product in int32 (`torch._int_mm`, oneDNN/VNNI where the CPU has it).

`Int8Linear` holds the weight as int8 [out, in] plus a float32 scale per row: a quarter
of float32's bytes, the lever of a decode step that streams its weights. A row of
activations x gets its own scale s_x = max|x| / 127 and is rounded to int8; the output
is (q_x q_w^T) * s_x * s_w. `int8_linear_reference` is that math in float, the kernel's
test reference. The int8 values and scales are the checkpoint's own: the loader puts a
W8A8 linear's stored rows into an `Int8Linear` (transport/weights/checkpoint.py), fused
projections row by row, with no float copy; what the release left in float (lm_head,
routers) stays float. `float_linears` turns them back into float `nn.Linear`s, for the
wrappers that read a float weight (LoRA).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

@contextmanager
def one_thread():
    """torch's ops inside run on the calling thread alone. The rounding of the activations
    and the scaling of the int32 products are a few elementwise passes each, each one of
    torch's parallel regions once a tensor passes 32,768 elements; a region waits for
    every thread, and on a host whose cores are shared (other workers, spinning threads)
    that wait cost more than the GEMM: measured on 2 shared cores, 32 rows, a small
    preset layer's four linears: 20-30 ms in regions against 8 ms on one thread
    (docs/benchmarks.md, W8A8). The GEMM itself keeps every thread."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [rows, k] -> (int8 [rows, k], float32 scale [rows, 1]): symmetric, per row."""
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / 127
    return (x / scale).round().clamp(-127, 127).to(torch.int8), scale


def int8_linear_reference(x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's math in float32: x [n, in], weight_q int8 [out, in], weight_scale [out]."""
    q, s = quantize_rows(x.float())
    return F.linear(q.float() * s, weight_q.float() * weight_scale[:, None], bias)


class Int8Linear(nn.Module):
    """`nn.Linear`'s forward on an int8 weight with per-row scales; dynamic per-token activations."""

    def __init__(self, weight_q: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        assert weight_q.dtype == torch.int8 and weight_scale.shape == (weight_q.shape[0],)
        self.out_features, self.in_features = weight_q.shape
        self.register_buffer("weight_q", weight_q.contiguous())
        self.register_buffer("weight_scale", weight_scale.float().view(1, -1))  # [1, out]
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] float32 -> [..., out] float32."""
        rows = x.reshape(-1, self.in_features)
        with one_thread():
            q, s = quantize_rows(rows)
        acc = torch._int_mm(q, self.weight_q.t())  # [rows, out] int32; the transposed view is what it runs fastest
        with one_thread():
            out = torch.mul(acc, s).mul_(self.weight_scale)  # int32 * float32 -> float32 in one pass
            if self.bias is not None:
                out += self.bias
        return out.view(*x.shape[:-1], self.out_features)

    @property
    def weight(self) -> torch.Tensor:
        """The float32 weight [out, in] it stands for: int8 x its row's scale (a copy)."""
        return self.weight_q.float() * self.weight_scale.view(-1, 1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def float_linears(model: nn.Module) -> int:
    """Replaces every `Int8Linear` under `model` by the float `nn.Linear` of its dequantized
    weight (int8 x its row's scale, as the checkpoint's format defines it); returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is Int8Linear:
                linear = nn.Linear(1, 1, bias=False)  # its shape and tensors are set below
                linear.in_features, linear.out_features = child.in_features, child.out_features
                linear.weight = nn.Parameter(child.weight, requires_grad=False)
                linear.bias = child.bias
                setattr(parent, name, linear)
                count += 1
    return count
