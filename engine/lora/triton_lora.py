"""The gathered low-rank matmul of Multi-LoRA in Triton (GPU): vLLM's punica idea.

The step's adapter rows come sorted by slot, each slot's run padded to whole
tiles of BLOCK_M rows (`SlotTiles`, built once a step by `step_rows.step_rows`
and shared by every projection), so every tile belongs to one slot. Two
grouped GEMMs then run over the tiles:
  1. shrink: t[tile row] = x[row] @ A[slot]^T       ([BLOCK_M, R]: R = pieces x max_rank)
  2. expand: y[row] += t[tile row] @ B[slot]^T * scaling[slot], in place
Rows of no adapter are in no tile and keep the base projection's output; the
zero rows and columns of ranks below max_rank add exact zeros. Nothing is
synchronised with the host. Reference: `layers.add_lora_torch` (the CPU
path), tested against it under TRITON_INTERPRET=1 (tests/unit/engine/test_lora_triton.py).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from epd.engine.lora.step_rows import BLOCK_M, SlotTiles

# The interpreter multiplies bf16 as raw uint16 in tl.dot: upcast there.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
SHRINK_BLOCK_R = 16
SHRINK_BLOCK_K = 64
EXPAND_BLOCK_N = 64
EXPAND_BLOCK_R = 16


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, t_ptr, rows_ptr, tile_slots_ptr,
    R, K,
    stride_xm, stride_xk,  # x [num_tokens, K]
    stride_as, stride_ar, stride_ak,  # a [num_slots, R, K]
    stride_tm, stride_tr,  # t [num_tiles * BLOCK_M, R]
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    slot = tl.load(tile_slots_ptr + tile).to(tl.int64)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row = tl.load(rows_ptr + offs_m).to(tl.int64)
    valid = row >= 0  # padding rows of a slot's last tile are -1
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    a_base = a_ptr + slot * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        x = tl.load(x_ptr + row[:, None] * stride_xm + kk[None, :] * stride_xk,
                    mask=valid[:, None] & (kk[None, :] < K), other=0.0)  # [BLOCK_M, BLOCK_K]
        a = tl.load(a_base + offs_r[None, :] * stride_ar + kk[:, None] * stride_ak,
                    mask=(kk[:, None] < K) & (offs_r[None, :] < R), other=0.0)  # [BLOCK_K, BLOCK_R]
        if UPCAST:
            x, a = x.to(tl.float32), a.to(tl.float32)
        acc += tl.dot(x, a, input_precision=PRECISION)
    tl.store(t_ptr + offs_m[:, None] * stride_tm + offs_r[None, :] * stride_tr, acc.to(t_ptr.dtype.element_ty),
             mask=offs_r[None, :] < R)


@triton.jit
def _lora_expand_kernel(
    t_ptr, b_ptr, y_ptr, rows_ptr, tile_slots_ptr, tile_scaling_ptr,
    N, R,
    stride_tm, stride_tr,  # t [num_tiles * BLOCK_M, R]
    stride_bs, stride_bn, stride_br,  # b [num_slots, N, R]
    stride_ym, stride_yn,  # y [num_tokens, N]
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    tile = tl.program_id(0)
    slot = tl.load(tile_slots_ptr + tile).to(tl.int64)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row = tl.load(rows_ptr + offs_m).to(tl.int64)
    valid = row >= 0
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    b_base = b_ptr + slot * stride_bs
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rr = r0 + offs_r
        t = tl.load(t_ptr + offs_m[:, None] * stride_tm + rr[None, :] * stride_tr,
                    mask=rr[None, :] < R, other=0.0)  # [BLOCK_M, BLOCK_R]
        b = tl.load(b_base + offs_n[None, :] * stride_bn + rr[:, None] * stride_br,
                    mask=(rr[:, None] < R) & (offs_n[None, :] < N), other=0.0)  # [BLOCK_R, BLOCK_N]
        if UPCAST:
            t, b = t.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(t, b, input_precision=PRECISION)
    acc = acc * tl.load(tile_scaling_ptr + tile)
    # each row is in one tile only: a plain read-add-write, no atomics
    y_ptrs = y_ptr + row[:, None] * stride_ym + offs_n[None, :] * stride_yn
    mask = valid[:, None] & (offs_n[None, :] < N)
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             tiles: SlotTiles) -> None:
    """y [num_tokens, out] += (x[rows] @ A[slot]^T) @ B[slot]^T * scaling per tile, in place;
    x [num_tokens, in], lora_a [num_slots, R, in], lora_b [num_slots, out, R]."""
    num_tokens, k = x.shape
    num_slots, r, k_a = lora_a.shape
    out = y.shape[1]
    assert k_a == k and y.shape[0] == num_tokens and lora_b.shape == (num_slots, out, r), \
        f"x {tuple(x.shape)}, y {tuple(y.shape)}, A {tuple(lora_a.shape)}, B {tuple(lora_b.shape)} do not fit"
    num_tiles = tiles.tile_slots.numel()
    assert tiles.rows.numel() == num_tiles * BLOCK_M and tiles.tile_scaling.numel() == num_tiles
    if num_tiles == 0:
        return
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # float32 stays float32 (no TF32)
    upcast = _INTERPRET and x.dtype == torch.bfloat16
    t = torch.empty(num_tiles * BLOCK_M, r, dtype=x.dtype, device=x.device)  # [num_tiles * BLOCK_M, R]
    _lora_shrink_kernel[(num_tiles, triton.cdiv(r, SHRINK_BLOCK_R))](
        x, lora_a, t, tiles.rows, tiles.tile_slots, r, k,
        x.stride(0), x.stride(1), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), t.stride(0), t.stride(1),
        PRECISION=precision, UPCAST=upcast, BLOCK_M=BLOCK_M, BLOCK_R=SHRINK_BLOCK_R, BLOCK_K=SHRINK_BLOCK_K)
    _lora_expand_kernel[(num_tiles, triton.cdiv(out, EXPAND_BLOCK_N))](
        t, lora_b, y, tiles.rows, tiles.tile_slots, tiles.tile_scaling, out, r,
        t.stride(0), t.stride(1), lora_b.stride(0), lora_b.stride(1), lora_b.stride(2), y.stride(0), y.stride(1),
        PRECISION=precision, UPCAST=upcast, BLOCK_M=BLOCK_M, BLOCK_N=EXPAND_BLOCK_N, BLOCK_R=EXPAND_BLOCK_R)
