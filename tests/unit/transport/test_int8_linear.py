"""INT8 W8A8 on the CPU: the int32 kernel against its float reference, and which weights are exactly int8."""
from __future__ import annotations

import torch
from torch import nn

from epd.transport.weights.quant.int8_linear import Int8Linear, exact_int8, int8_linear_reference, int8_linears


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


def test_weights_exactly_int8_times_a_row_scale_are_found_and_others_are_not():
    torch.manual_seed(0)
    q = torch.randint(-127, 128, (16, 32), dtype=torch.int8)
    q[:, 0] = 127  # each row's max |q|: 127, so max|w| / 127 is its scale
    scale = torch.rand(16) + 0.1
    found = exact_int8(q.float() * scale[:, None])
    assert found is not None and torch.equal(found[0], q) and torch.allclose(found[1], scale)
    q[:, 0] = -128  # compressed-tensors' observer: max|w| / 127.5, -128 allowed
    assert exact_int8(q.float() * scale[:, None]) is not None
    assert exact_int8(torch.randn(16, 32)) is None


def test_only_exact_linears_are_replaced():
    model = nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 8))
    with torch.no_grad():
        q = torch.randint(-127, 128, (16, 32)).float()
        q[:, 0] = 127
        model[0].weight.copy_(q * 0.01)
    assert int8_linears(model) == 1
    assert type(model[0]) is Int8Linear and type(model[1]) is nn.Linear


def test_a_row_whose_largest_value_is_below_127_is_found_too():
    q = torch.randint(-127, 128, (8, 32), dtype=torch.int8)
    q[:, 0] = 127
    q[3] = torch.randint(-90, 91, (32,), dtype=torch.int8)  # one row whose largest |q| is 90
    q[3, 0] = 90
    scale = torch.rand(8) + 0.1
    found = exact_int8(q.float() * scale[:, None])
    assert found is not None
    assert torch.allclose(found[0].float() * found[1][:, None], q.float() * scale[:, None], rtol=1e-6)
