"""The oneDNN-packed CPU linears against torch's own computation: the plain
projection, the projection with its residual add as a post-op, and the SwiGLU
gate/up pair with the activation and the product as post-ops; and what is left
unpacked (bfloat16, biases on a gate/up)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from epd.transport.weights.cpu_linear import (PackedLinear, PackedSwiGLU, linear_add, pack_linears, pack_swiglu,
                                      swiglu)

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
ROWS = (1, 7, 64)  # a decode, an odd batch, a prefill chunk


def _linear(in_features: int, out_features: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_and_its_add_match_torch(rows, bias):
    plain = _linear(48, 40, bias)
    packed = PackedLinear(plain)
    x, other = torch.randn(rows, 48), torch.randn(rows, 40)
    with torch.no_grad():
        want = plain(x)
        torch.testing.assert_close(packed(x), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed.add(x, other), other + want, atol=1e-5, rtol=1e-5)
        # linear_add: the post-op on a packed projection, the plain sum on any other
        torch.testing.assert_close(linear_add(packed, x, other), other + want, atol=1e-5, rtol=1e-5)
        assert torch.equal(linear_add(plain, x, other), other + want)


@pytest.mark.parametrize("rows", ROWS)
def test_packed_swiglu_matches_silu_gate_times_up(rows):
    gate_up = _linear(32, 2 * 24, bias=False)
    x = torch.randn(rows, 32) * 3  # activations on both sides of silu's bend
    with torch.no_grad():
        gate, up = gate_up(x).split(24, dim=-1)
        want = F.silu(gate) * up
        assert torch.equal(swiglu(gate_up, x, 24), want)  # the reference path
        packed = PackedSwiGLU(gate_up, 24)
        got = swiglu(packed, x, 24)
    assert got.shape == (rows, 24)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_pack_swiglu_then_pack_linears_pack_each_projection_once():
    mlp = nn.Module()
    mlp.gate_up_proj, mlp.down_proj = _linear(16, 2 * 8, bias=False), _linear(8, 16, bias=False)
    assert pack_swiglu(mlp, "gate_up_proj", 8)
    assert pack_linears(mlp) == 1  # only down_proj is left a plain nn.Linear
    assert type(mlp.gate_up_proj) is PackedSwiGLU and type(mlp.down_proj) is PackedLinear


def test_what_cannot_be_packed_is_left_alone():
    mlp = nn.Module()
    mlp.gate_up_proj = _linear(16, 2 * 8, bias=True)  # a bias has no place in the gate's post-op
    assert not pack_swiglu(mlp, "gate_up_proj", 8) and type(mlp.gate_up_proj) is nn.Linear
    mlp.gate_up_proj = _linear(16, 2 * 8, bias=False).to(torch.bfloat16)
    assert not pack_swiglu(mlp, "gate_up_proj", 8)
    assert pack_linears(mlp) == 0 and type(mlp.gate_up_proj) is nn.Linear
