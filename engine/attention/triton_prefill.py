"""Triton paged prefill attention (flash-attention style, causal with offset).

Grid: (query tiles, sequences, q heads). A program takes BLOCK_M query rows
of one sequence and one q head, and streams that sequence's keys, cached
prefix and new tokens alike, from the paged cache in BLOCK_N tiles with an
online softmax in float32. Query row j of sequence b sits at absolute
position seq_len - q_len + j and sees keys 0..that position, or to the end
of the bidirectional range holding it (`meta.query_key_ends`), and within a
sliding window only keys after position - window (the loop starts at the
tile's first visible key); a soft-cap squashes scores before the mask. The
options are runtime arguments, not compile-time ones: no extra compiled
variants, and a CUDA graph replays them as constants of the layer. Any
q_len works (decodes in a mixed batch included). Reference:
`engine.attention.torch_attention.attention`.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from epd.engine.attention.metadata import AttentionMetadata, check_attention_inputs, check_options

# The interpreter multiplies bf16 as raw uint16 in tl.dot: upcast there.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
LOG2E = 1.0 / math.log(2.0)
NO_WINDOW = 1 << 30  # the window of a global layer: every key is inside it


def kernel_options(window: int | None, softcap: float | None) -> tuple[int, float]:
    """A layer's options as the kernels take them: (window, soft-cap in base 2, 0 for none)."""
    check_options(window, softcap)
    return (NO_WINDOW if window is None else window), (0.0 if softcap is None else softcap * LOG2E)


@triton.jit
def soft_cap(s, cap):
    """cap * tanh(s / cap), tanh(x) = 1 - 2 / (exp(2x) + 1): exp's overflow gives +-1, no NaN."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * s / cap) + 1.0))


@triton.jit
def load_kv_tile(table, k_cache_ptr, v_cache_ptr, offs_n, mask_n, offs_d, mask_d, kv_head,
                 stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                 BLOCK_SIZE: tl.constexpr, UPCAST: tl.constexpr):
    """K and V rows [N, D] of one kv head at token positions `offs_n` of one
    sequence, read from the paged cache through its block table `table`."""
    block_ids = tl.load(table + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
    in_block = offs_n % BLOCK_SIZE
    kv_mask = mask_n[:, None] & mask_d[None, :]
    k = tl.load(k_cache_ptr + block_ids[:, None] * stride_kb + in_block[:, None] * stride_ks
                + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + block_ids[:, None] * stride_vb + in_block[:, None] * stride_vs
                + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


# the block tables' width changes step to step: one compiled variant for every width
@triton.jit(do_not_specialize=["stride_bt", "has_key_ends", "window", "softcap_log2"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr,
    key_ends_ptr,  # [num_tokens] int32: meta.query_key_ends, read when has_key_ends
    has_key_ends,
    window,  # the layer's sliding window (NO_WINDOW: global)
    softcap_log2,  # the layer's soft-cap in base 2 (0: none)
    scale_log2,  # softmax scale * log2(e): scores live in base 2
    stride_qt, stride_qh,  # query [num_tokens, Hq, D]
    stride_ot, stride_oh,  # out [num_tokens, Hq, D]
    stride_kb, stride_ks, stride_kh,  # k_cache [num_blocks, block_size, Hkv, D]
    stride_vb, stride_vs, stride_vh,  # v_cache
    stride_bt,  # block_tables [num_seqs, max_num_blocks]
    head_dim,
    NUM_GROUPS: tl.constexpr,  # q heads per kv head
    BLOCK_SIZE: tl.constexpr,  # cache block (page) size
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,  # compute tl.dot in float32 (bf16 under the interpreter)
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs: no tf32 rounding
):
    pid_m = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if pid_m * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len
    kv_head = head // NUM_GROUPS

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < q_len
    mask_d = offs_d < head_dim
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [M, D]
    if UPCAST:
        q = q.to(tl.float32)
    positions = prefix_len + offs_m  # [M] absolute positions
    last = positions  # [M] the last key each row sees (padded rows: as if causal)
    kv_end = tl.minimum(seq_len, prefix_len + (pid_m + 1) * BLOCK_M)  # last tile row's causal limit
    if has_key_ends:  # bidirectional ranges: a row in one sees to its end
        last = tl.where(mask_m, tl.load(key_ends_ptr + rows, mask=mask_m, other=1) - 1, positions)
        kv_end = tl.minimum(seq_len, tl.max(last, axis=0) + 1)
    kv_start = tl.maximum(prefix_len + pid_m * BLOCK_M - window + 1, 0)  # the first row's first key

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start_n in range(kv_start, kv_end, BLOCK_N):
        offs_n = start_n + offs_n0
        mask_n = offs_n < kv_end
        k, v = load_kv_tile(table, k_cache_ptr, v_cache_ptr, offs_n, mask_n, offs_d, mask_d, kv_head,
                            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                            BLOCK_SIZE, UPCAST)  # [N, D] each
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [M, N]
        if softcap_log2 > 0:
            s = soft_cap(s, softcap_log2)
        visible = (offs_n[None, :] <= last[:, None]) & (offs_n[None, :] > positions[:, None] - window) \
            & mask_n[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees no key yet: p = 0, no NaN
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l_i = 0: a padded row, not stored
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta: AttentionMetadata, scale: float, window: int | None = None,
                            softcap: float | None = None) -> torch.Tensor:
    """Causal paged attention for any batch (prefill chunks, decodes, mixed), with the
    metadata's bidirectional ranges and the layer's `window` and `softcap` (as the torch backend).

    query [num_tokens, num_q_heads, head_dim] -> out, same shape and dtype.
    """
    check_attention_inputs(query, k_cache, v_cache, meta)
    check_kernel_layout(query, k_cache, v_cache, meta)
    window, softcap_log2 = kernel_options(window, softcap)
    key_ends = meta.query_key_ends
    if key_ends is not None and (key_ends.dtype != torch.int32 or key_ends.device != query.device):
        raise ValueError("meta.query_key_ends must be int32 on the query's device")
    out = torch.empty_like(query)
    num_seqs = meta.num_seqs
    if query.shape[0] == 0 or num_seqs == 0:
        return out
    num_q_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1:3]
    block_m = 64 if meta.max_seqlen_q >= 64 else max(16, triton.next_power_of_2(meta.max_seqlen_q))
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = 32 if query.dtype == torch.float32 and block_d > 64 else 64  # fp32 tiles are twice the bytes
    grid = (triton.cdiv(meta.max_seqlen_q, block_m), num_seqs, num_q_heads)
    _prefill_kernel[grid](
        query, k_cache, v_cache, out,
        meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
        meta.seq_lens if key_ends is None else key_ends, int(key_ends is not None), window, softcap_log2,
        scale * LOG2E,
        query.stride(0), query.stride(1),
        out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        meta.block_tables.stride(0),
        head_dim,
        NUM_GROUPS=num_q_heads // num_kv_heads,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        UPCAST=_INTERPRET and query.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=4,
        num_stages=2,
    )
    return out


def check_kernel_layout(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata) -> None:
    """What the kernels assume beyond the shared contract: unit stride in
    head_dim, one device, int32 index tensors."""
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim")
    for name, t in (("cu_seqlens_q", meta.cu_seqlens_q), ("seq_lens", meta.seq_lens),
                    ("block_tables", meta.block_tables)):
        if t.dtype != torch.int32:
            raise ValueError(f"meta.{name} must be int32, got {t.dtype}")
        if t.device != query.device:
            raise ValueError(f"meta.{name} is on {t.device}, query on {query.device}")
    if k_cache.device != query.device or v_cache.device != query.device:
        raise ValueError("query and caches must be on one device")
    if meta.block_tables.shape[1] and meta.block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
