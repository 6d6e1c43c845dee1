"""The CPU Gated DeltaNet kernel (gated_delta_cpu.c): built once, loaded with ctypes.

Between its projections a Gated DeltaNet layer is many small torch ops (the conv, SiLU, two L2
norms, the gates, the delta rule, the gated RMSNorm) on states gathered out of their slots and
scattered back, and a prefill chunk's chunked rule adds triangular solves: on CPU these cost
several times the projections. The kernel runs a whole step's sequences, decodes and prefill
chunks alike, in one call: the recurrent rule token by token per head, each sequence's conv and
recurrent state read and written in place in its slot. The torch path (gated_deltanet.py's:
causal_conv1d.py, gated_delta.py, GatedRMSNorm) stays the fallback and the reference the tests
compare against. Built by transport/weights/c_library.py; without a
compiler (or with `EPD_CPU_GDN_KERNEL=0`) `load()` returns None and the layer keeps the torch path.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from epd.transport.weights import c_library

SOURCE = Path(__file__).with_name("gated_delta_cpu.c")
MAX_HEAD_DIM, MAX_CONV_KERNEL = 256, 8  # the kernel's buffers
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_KERNEL = c_library.Kernel(
    SOURCE, "epd_gated_delta",
    [_P] * 14 + [_I64] * 7 + [ctypes.c_float, _P, _P, ctypes.c_int, ctypes.c_int], None,
    switch="EPD_CPU_GDN_KERNEL", what="CPU Gated DeltaNet kernel", fallback="Gated DeltaNet layers run torch ops")


def load():
    """The kernel's ctypes function, or None where it cannot be built (logged once)."""
    return _KERNEL.load()


def _load():
    """The kernel built now, not remembered (tests: the switch and the no-compiler case)."""
    return _KERNEL.build()


def applies(mixed: torch.Tensor, rec_states: torch.Tensor, k_dim: int, v_dim: int, kernel: int) -> bool:
    """Whether the kernel serves these tensors: CPU, float32 or bfloat16, float32 states, sizes it holds."""
    return (mixed.device.type == "cpu" and mixed.dtype in (torch.float32, torch.bfloat16)
            and rec_states.dtype == torch.float32 and k_dim <= MAX_HEAD_DIM and v_dim <= MAX_HEAD_DIM
            and kernel <= MAX_CONV_KERNEL)


def gated_delta(fn, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, z: torch.Tensor, conv_states: torch.Tensor,
                conv_weight: torch.Tensor, rec_states: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                norm_weight: torch.Tensor, eps: float, start: torch.Tensor, num_tokens: torch.Tensor,
                slots: torch.Tensor, fresh: torch.Tensor, num_k_heads: int, out: torch.Tensor) -> None:
    """Writes `out`'s rows of the listed sequences (each `num_tokens[s]` rows from `start[s]`, its
    states in slot `slots[s]`, from zeros where `fresh[s]`; int64, `fresh` int32) and updates their
    states in place: mixed [rows, conv_dim], a, b [rows, Hv], z and out [rows, Hv * Dv], all in one
    dtype (float32 or bfloat16) as conv_states [num_slots, conv_dim, K - 1] and conv_weight
    [conv_dim, K]; rec_states [num_slots, Hv, Dk, Dv] float32; A_log, dt_bias [Hv], norm_weight [Dv]."""
    num_slots, num_v_heads, k_dim, v_dim = rec_states.shape
    conv_dim, kernel = conv_weight.shape
    dtype = mixed.dtype
    assert mixed.shape[1] == conv_dim == 2 * num_k_heads * k_dim + num_v_heads * v_dim, (mixed.shape, conv_weight.shape)
    assert conv_states.shape == (num_slots, conv_dim, kernel - 1), (conv_states.shape, conv_weight.shape)
    assert all(t.dtype == dtype and t.is_contiguous() for t in (mixed, a, b, z, conv_states, conv_weight, out))
    assert z.shape == out.shape == (mixed.shape[0], num_v_heads * v_dim) and rec_states.is_contiguous()
    assert a.shape == b.shape == (mixed.shape[0], num_v_heads), (a.shape, b.shape)
    assert start.dtype == num_tokens.dtype == slots.dtype == torch.int64 and fresh.dtype == torch.int32
    assert start.shape == num_tokens.shape == slots.shape == fresh.shape
    assert k_dim <= MAX_HEAD_DIM and v_dim <= MAX_HEAD_DIM and kernel <= MAX_CONV_KERNEL
    A_log, dt_bias, norm_weight = (t.detach().float().contiguous() for t in (A_log, dt_bias, norm_weight))
    conv_out = torch.empty(mixed.shape[0], conv_dim, dtype=torch.float32)  # the kernel's scratch
    fn(mixed.data_ptr(), a.data_ptr(), b.data_ptr(), z.data_ptr(), conv_states.data_ptr(), conv_weight.data_ptr(),
       rec_states.data_ptr(), A_log.data_ptr(), dt_bias.data_ptr(), norm_weight.data_ptr(), start.data_ptr(),
       num_tokens.data_ptr(), slots.data_ptr(), fresh.data_ptr(), start.numel(), conv_dim, kernel, num_k_heads,
       num_v_heads, k_dim, v_dim, eps, conv_out.data_ptr(), out.data_ptr(), int(dtype == torch.bfloat16),
       torch.get_num_threads())
