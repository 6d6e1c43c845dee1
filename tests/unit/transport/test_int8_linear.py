"""INT8 W8A8 on the CPU: the int32 kernel against its float reference, and its float form for LoRA."""
from __future__ import annotations

import torch
from torch import nn

from epd.transport.weights.quant.int8_linear import Int8Linear, float_linears, int8_linear_reference


def test_the_kernel_is_its_reference():
    torch.manual_seed(0)
    q = torch.randint(-127, 128, (48, 64), dtype=torch.int8)
    scale = torch.rand(48) / 50
    bias = torch.randn(48)
    layer = Int8Linear(q, scale, bias)
    for rows in (1, 7, 33):
        x = torch.randn(rows, 64)
        want = int8_linear_reference(x, q, scale, bias)
        assert torch.allclose(layer(x), want, rtol=1e-5, atol=1e-5)
    x = torch.randn(2, 3, 64)  # leading dims kept
    assert layer(x).shape == (2, 3, 48)


def test_float_linears_hold_the_dequantized_weight():
    torch.manual_seed(0)
    q = torch.randint(-127, 128, (16, 32), dtype=torch.int8)
    scale = torch.rand(16) + 0.1
    bias = torch.randn(16)
    model = nn.Sequential(Int8Linear(q, scale, bias), nn.Linear(16, 8))
    assert float_linears(model) == 1
    linear = model[0]
    assert type(linear) is nn.Linear and (linear.in_features, linear.out_features) == (32, 16)
    assert torch.equal(linear.weight, q.float() * scale[:, None]) and torch.equal(linear.bias, bias)
    x = torch.randn(3, 32)
    assert torch.allclose(linear(x), x @ (q.float() * scale[:, None]).t() + bias, rtol=1e-5, atol=1e-5)
