"""Triton paged decode attention (a few queries per sequence, split-K).

Flash-decoding: grid (sequences, kv heads, splits). A program loads the
query rows of all q heads sharing one kv head (GQA: K/V are read once per
group) for each of the sequence's query tokens (one for a decode; the last
token and its draft when speculative decoding verifies one, causal among
them: rows (token j, group g), token j sees keys up to seq_len - q_len + j),
and streams its share of the sequence's keys (1/num_splits of them) from
the paged cache with an online softmax in float32; with a sliding window
the splits share only the keys the window shows (from the first row's
first visible key), and a soft-cap squashes scores before the mask, both
runtime arguments as in triton_prefill.py. Bidirectional ranges are the
prefill kernel's. With one split it
writes the output directly; otherwise it writes an unnormalised partial
(acc, running max, running sum) and a second kernel merges the splits.
Decode is memory bound: splits keep the GPU busy when
num_seqs * num_kv_heads is small. Reference:
`engine.attention.torch_attention.attention`.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from epd.engine.attention.metadata import AttentionMetadata, check_attention_inputs
from epd.engine.attention.triton_prefill import check_kernel_layout, kernel_options, load_kv_tile, soft_cap

# The interpreter multiplies bf16 as raw uint16 in tl.dot: upcast there.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
LOG2E = 1.0 / math.log(2.0)
MAX_SPLITS = 32
MAX_QUERY_LEN = 16  # query tokens of a sequence (a decode's draft + 1) the decode kernel takes
MIN_KEYS_PER_SPLIT = 128


# the block tables' width changes step to step: one compiled variant for every width
@triton.jit(do_not_specialize=["stride_bt", "window", "softcap_log2"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr,  # [num_tokens, Hq, NUM_SPLITS, D] / [num_tokens, Hq, NUM_SPLITS]
    cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr,
    window,  # the layer's sliding window (NO_WINDOW: global)
    softcap_log2,  # the layer's soft-cap in base 2 (0: none)
    scale_log2,  # softmax scale * log2(e): scores live in base 2
    stride_qt, stride_qh,  # query [num_tokens, Hq, D]
    stride_ot, stride_oh,  # out [num_tokens, Hq, D]
    stride_kb, stride_ks, stride_kh,  # k_cache [num_blocks, block_size, Hkv, D]
    stride_vb, stride_vs, stride_vh,  # v_cache
    stride_bt,  # block_tables [num_seqs, max_num_blocks]
    num_q_heads, head_dim,
    NUM_GROUPS: tl.constexpr,  # q heads per kv head
    NUM_SPLITS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # cache block (page) size
    BLOCK_G: tl.constexpr,  # rows: max query tokens x NUM_GROUPS, padded to a tl.dot-able size
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,  # compute tl.dot in float32 (bf16 under the interpreter)
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs: no tf32 rounding
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    first_key = tl.maximum(seq_len - q_len - window + 1, 0)  # the first row's first visible key
    split_len = tl.cdiv(tl.cdiv(seq_len - first_key, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = first_key + split * split_len
    end = tl.minimum(start + split_len, seq_len)  # start >= end: empty split (short sequence)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    token = offs_g // NUM_GROUPS  # [R] row r: query token r // G, q head r % G of this kv head
    mask_g = token < q_len
    mask_d = offs_d < head_dim
    heads = kv_head * NUM_GROUPS + offs_g % NUM_GROUPS  # [R]
    row = (q_start + token).to(tl.int64)  # [R] rows of the batch
    last_key = seq_len - q_len + token  # [R] causal: the last key each row sees (padding rows: all)
    q = tl.load(q_ptr + row[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)  # [R, D]
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + offs_n0
        mask_n = offs_n < end
        k, v = load_kv_tile(table, k_cache_ptr, v_cache_ptr, offs_n, mask_n, offs_d, mask_d, kv_head,
                            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                            BLOCK_SIZE, UPCAST)  # [N, D] each
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [R, N]
        if softcap_log2 > 0:
            s = soft_cap(s, softcap_log2)
        visible = mask_n[None, :] & (offs_n[None, :] <= last_key[:, None]) \
            & (offs_n[None, :] > last_key[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees no key yet: p = 0, no NaN
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    mask_out = mask_g[:, None] & mask_d[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + row[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=mask_out)
    else:
        part = (row * num_q_heads + heads) * NUM_SPLITS + split  # [R]
        tl.store(part_acc_ptr + part[:, None] * head_dim + offs_d[None, :], acc, mask=mask_out)
        tl.store(part_max_ptr + part, m_i, mask=mask_g)
        tl.store(part_sum_ptr + part, l_i, mask=mask_g)


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    stride_ot, stride_oh,
    num_q_heads, head_dim,
    NUM_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # a query token of the batch
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    part = (row * num_q_heads + head) * NUM_SPLITS + offs_s  # [S]
    m = tl.load(part_max_ptr + part)  # [S], -inf for empty splits
    l = tl.load(part_sum_ptr + part)  # [S]
    acc = tl.load(part_acc_ptr + part[:, None] * head_dim + offs_d[None, :], mask=mask_d[None, :], other=0.0)
    m_all = tl.max(m, axis=0)  # finite: some split holds the row's own key
    w = tl.exp2(m - m_all)  # [S]
    o = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)  # [D]
    tl.store(out_ptr + row * stride_ot + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=mask_d)


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float, num_splits: int | None = None,
                           window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Paged attention for a batch of decodes: every sequence has at most
    MAX_QUERY_LEN query tokens (1, or a draft's verification), none in a
    bidirectional range; the layer's `window` and `softcap` as the torch backend's.

    query [num_tokens, num_q_heads, head_dim] -> out, same shape and dtype.
    `num_splits` (a power of two) overrides the split-K heuristic; pass a
    fixed value where the launch must not depend on the batch (CUDA graphs).
    """
    check_attention_inputs(query, k_cache, v_cache, meta)
    check_kernel_layout(query, k_cache, v_cache, meta)
    if meta.max_seqlen_q > MAX_QUERY_LEN:
        raise ValueError(f"paged_decode_attention takes at most {MAX_QUERY_LEN} query tokens a sequence, "
                         f"got {meta.max_seqlen_q}")
    if meta.query_key_ends is not None:
        raise ValueError("bidirectional ranges are the prefill kernel's (paged_prefill_attention)")
    num_keys = meta.max_seqlen_k if window is None else min(meta.max_seqlen_k, window + meta.max_seqlen_q)
    window, softcap_log2 = kernel_options(window, softcap)
    out = torch.empty_like(query)
    num_seqs = meta.num_seqs
    if num_seqs == 0:
        return out
    num_q_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1:3]
    num_groups = num_q_heads // num_kv_heads
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs * num_kv_heads, num_keys, query.device)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = 32 if query.dtype == torch.float32 and block_d > 64 else 64
    num_tokens = query.shape[0]
    if num_splits > 1:
        f32 = dict(dtype=torch.float32, device=query.device)
        part_acc = torch.empty(num_tokens, num_q_heads, num_splits, head_dim, **f32)
        part_max = torch.empty(num_tokens, num_q_heads, num_splits, **f32)
        part_sum = torch.empty_like(part_max)
    else:  # unused by the kernel
        part_acc = part_max = part_sum = out
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, out,
        part_acc, part_max, part_sum,
        meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
        window, softcap_log2,
        scale * LOG2E,
        query.stride(0), query.stride(1),
        out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        meta.block_tables.stride(0),
        num_q_heads, head_dim,
        NUM_GROUPS=num_groups,
        NUM_SPLITS=num_splits,
        BLOCK_SIZE=block_size,
        BLOCK_G=block_g(num_groups, meta.max_seqlen_q),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        UPCAST=_INTERPRET and query.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            out, part_acc, part_max, part_sum,
            out.stride(0), out.stride(1),
            num_q_heads, head_dim,
            NUM_SPLITS=num_splits,
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out


def block_g(num_groups: int, max_query_len: int) -> int:
    """Rows of a decode program's tile: query tokens x q heads of one kv head, padded to a
    power of two tl.dot takes (a compile-time size: each value is a compiled variant)."""
    return max(16, triton.next_power_of_2(num_groups * max_query_len))


def choose_num_splits(num_programs: int, max_seqlen_k: int, device: torch.device) -> int:
    """Smallest power of two giving ~2 programs per SM, capped so each split
    keeps >= MIN_KEYS_PER_SPLIT keys of the longest sequence."""
    num_sms = _num_sms(device)
    wanted = triton.cdiv(2 * num_sms, max(num_programs, 1))
    cap = max(1, min(MAX_SPLITS, max_seqlen_k // MIN_KEYS_PER_SPLIT))
    return min(triton.next_power_of_2(wanted), 1 << (cap.bit_length() - 1))


_NUM_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: a few splits, to exercise the merge
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _NUM_SMS:
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _NUM_SMS[index]
