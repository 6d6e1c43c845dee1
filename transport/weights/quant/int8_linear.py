"""INT8 W8A8 on the CPU: int8 weights per output channel, activations quantized per token
at run time, the product in int32 (`torch._int_mm`, oneDNN/VNNI where the CPU has it).

`Int8Linear` holds the weight as int8 [out, in] plus a float32 scale per row: a quarter
of float32's bytes, the lever of a decode step that streams its weights. A row of
activations x gets its own scale s_x = max|x| / 127 and is rounded to int8; the output
is (q_x q_w^T) * s_x * s_w. `int8_linear_reference` is that math in float, the kernel's
test reference. The int8 values come from the checkpoint's W8A8 weights as the loader
dequantized them (`int8_linears`): a linear whose float weight is not exactly int8 times
a per-row scale stays float (lm_head, routers, anything the release left out).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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
        q, s = quantize_rows(rows)
        acc = torch._int_mm(q, self.weight_q.t())  # [rows, out] int32; the transposed view is what it runs fastest
        out = acc.float().mul_(s).mul_(self.weight_scale)
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def exact_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(int8 [out, in], scale [out]) whose product is `weight` (to float32 rounding), or None.
    A row's scale is max|w| / k for k its largest |q|: 127 or 128 from the usual observers
    (128 where compressed-tensors' max|w| / 127.5 rounded the negative extreme to -128),
    else searched down from 126 for the few rows that need it (a GPTQ-made row)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1).clamp(min=1e-30)  # [out]
    scale = torch.zeros_like(amax)
    todo = torch.ones_like(amax, dtype=torch.bool)
    for k in (127, 128, *range(126, 0, -1)):
        rows = todo.nonzero().squeeze(1)
        if rows.numel() == 0:
            break
        r = w[rows] * (k / amax[rows, None])
        fits = ((r - r.round()).abs().amax(dim=1) < 1e-3) & (r.round().amin(dim=1) >= -128) \
            & (r.round().amax(dim=1) <= 127)
        scale[rows[fits]] = amax[rows[fits]] / k
        todo[rows[fits]] = False
        if k == 128 and todo.sum() * 2 > w.shape[0]:
            return None  # most rows fit no usual scale: a float weight (lm_head), not searched further
    if todo.any():
        return None
    return (w / scale[:, None]).round().to(torch.int8), scale


def int8_linears(model: nn.Module) -> int:
    """Replaces every CPU float32 `nn.Linear` whose weight is exactly int8 x a per-row scale
    (a W8A8 checkpoint's, dequantized by the loader) by an `Int8Linear`; returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.weight.device.type != "cpu" or child.weight.dtype != torch.float32:
                continue
            found = exact_int8(child.weight)
            if found is not None:
                setattr(parent, name, Int8Linear(*found, child.bias))
                count += 1
    return count
