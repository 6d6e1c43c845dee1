"""Fused MoE in Triton: the routed experts of every token, grouped by expert.

The (token, choice) pairs are sorted by expert and each expert's run padded
to whole BLOCK_M tiles (`align_by_expert`), so every tile of rows belongs to
one expert. Two grouped GEMMs then run over the tiles:
  1. inter = silu(x @ gate_e^T) * (x @ up_e^T), rows gathered from x (gate and
     up tiles share the loaded rows of x);
  2. out_pair = weight_pair * inter @ down_e^T, stored at the pair's row,
and the k rows of each token are summed. Nothing is synchronised with the
host: tile counts are the upper bound, surplus tiles exit at once.
Reference: `engine.layers.moe.fused_moe_torch` (tested under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# The interpreter multiplies bf16 as raw uint16 in tl.dot: upcast there.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32


@triton.jit
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, rows_ptr, tile_experts_ptr,
    N, K, top_k,
    stride_am, stride_ak,  # a: x [num_tokens, K] (GATHER) or inter [num_padded, K]
    stride_be, stride_bn, stride_bk,  # b: [num_experts, N (x2 when GATED), K]
    stride_cm, stride_cn,  # c: [num_padded, N] or, STORE_BY_PAIR, [num_tokens * top_k, N]
    GATHER: tl.constexpr,  # a's row is the pair's token (pair // top_k), else the tile row
    GATED: tl.constexpr,  # c = silu(a @ b[:N]^T) * (a @ b[N:]^T)
    STORE_BY_PAIR: tl.constexpr,  # c's row is the pair (times its routing weight), else the tile row
    PRECISION: tl.constexpr,  # "ieee" for float32 inputs: no tf32 rounding
    UPCAST: tl.constexpr,  # tl.dot in float32 (bf16 under the interpreter)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(tile_experts_ptr + tile).to(tl.int64)
    if expert < 0:  # surplus tile of the upper bound
        return
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(rows_ptr + offs_m).to(tl.int64)
    valid = pair >= 0  # padding rows of an expert's last tile are -1
    a_row = pair // top_k if GATHER else offs_m.to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    b_base = b_ptr + expert * stride_be
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        a = tl.load(a_ptr + a_row[:, None] * stride_am + kk[None, :] * stride_ak,
                    mask=valid[:, None] & (kk[None, :] < K), other=0.0)  # [BLOCK_M, BLOCK_K]
        b_mask = (kk[:, None] < K) & (offs_n[None, :] < N)
        b = tl.load(b_base + offs_n[None, :] * stride_bn + kk[:, None] * stride_bk, mask=b_mask, other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
        if GATED:
            b_up = tl.load(b_base + (offs_n[None, :] + N) * stride_bn + kk[:, None] * stride_bk,
                           mask=b_mask, other=0.0)
            if UPCAST:
                b_up = b_up.to(tl.float32)
            acc_up += tl.dot(a, b_up, input_precision=PRECISION)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    c_row = offs_m.to(tl.int64)
    if STORE_BY_PAIR:
        weight = tl.load(weights_ptr + pair, mask=valid, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
        c_row = pair
    tl.store(c_ptr + c_row[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & (offs_n[None, :] < N))


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [max_padded]: pair id or -1, tile_experts [max_tiles]: expert or -1).

    Each expert's pairs (stable, token order) start at a multiple of block_m;
    sizes are the upper bound for any routing, so no host sync is needed."""
    flat = topk_ids.flatten()
    num_pairs, device = flat.numel(), flat.device
    pairs = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts)  # [num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    count_start = counts.cumsum(0) - counts
    max_tiles = (num_pairs + block_m - 1) // block_m + num_experts
    rows = torch.full((max_tiles * block_m,), -1, dtype=torch.int64, device=device)
    expert_sorted = flat[pairs]
    rank = torch.arange(num_pairs, device=device) - count_start[expert_sorted]  # index within its expert
    rows[padded_end[expert_sorted] - padded[expert_sorted] + rank] = pairs
    tile_start = torch.arange(max_tiles, device=device) * block_m
    tile_experts = torch.searchsorted(padded_end, tile_start, right=True)
    tile_experts = torch.where(tile_experts < num_experts, tile_experts, -1)
    return rows, tile_experts


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, hidden], w13 [E, 2 * inter, hidden], w2 [E, hidden, inter],
    topk_weights / topk_ids [num_tokens, top_k] -> [num_tokens, hidden]."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter, top_k = two_inter // 2, topk_ids.shape[1]
    assert w13.shape == (num_experts, 2 * inter, hidden) and w2.shape == (num_experts, hidden, inter), \
        f"expert weights {tuple(w13.shape)}, {tuple(w2.shape)} do not fit hidden {hidden}"
    assert topk_weights.shape == topk_ids.shape and topk_ids.shape[0] == num_tokens
    if num_tokens == 0:
        return torch.zeros_like(x)
    rows, tile_experts = align_by_expert(topk_ids, num_experts)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # float32 stays float32 (no TF32)
    upcast = _INTERPRET and x.dtype == torch.bfloat16
    weights = topk_weights.contiguous().view(-1)
    inter_out = torch.empty(rows.numel(), inter, dtype=x.dtype, device=x.device)  # [max_padded, inter]
    grid = (tile_experts.numel(), triton.cdiv(inter, BLOCK_N))
    _moe_gemm_kernel[grid](
        x, w13, inter_out, weights, rows, tile_experts, inter, hidden, top_k,
        x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2),
        inter_out.stride(0), inter_out.stride(1),
        GATHER=True, GATED=True, STORE_BY_PAIR=False, PRECISION=precision, UPCAST=upcast,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    per_pair = torch.empty(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    grid = (tile_experts.numel(), triton.cdiv(hidden, BLOCK_N))
    _moe_gemm_kernel[grid](
        inter_out, w2, per_pair, weights, rows, tile_experts, hidden, inter, top_k,
        inter_out.stride(0), inter_out.stride(1), w2.stride(0), w2.stride(1), w2.stride(2),
        per_pair.stride(0), per_pair.stride(1),
        GATHER=False, GATED=False, STORE_BY_PAIR=True, PRECISION=precision, UPCAST=upcast,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return per_pair.view(num_tokens, top_k, hidden).sum(dim=1)
