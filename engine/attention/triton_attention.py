"""Triton attention backend: the GPU serving path.

`store_kv` scatters new K/V into the paged cache; `attention` runs the
split-K decode kernel for decodes (one query token each) and for decodes
verifying a draft (a few tokens each, at most MAX_DECODE_ROWS rows of query
tokens x q heads per kv head: the program's tile), and the paged prefill
kernel (which handles any mix of prefill chunks and decodes) otherwise.
Kernels live in triton_store.py / triton_prefill.py /
triton_decode.py; the torch backend is their reference.
"""
from __future__ import annotations

import torch

from epd.engine.attention.metadata import AttentionMetadata
from epd.engine.attention.triton_decode import MAX_QUERY_LEN, MAX_SPLITS, block_g, paged_decode_attention
from epd.engine.attention.triton_prefill import paged_prefill_attention
from epd.engine.attention.triton_store import store_kv

MAX_DECODE_ROWS = 64  # query tokens x q heads of one kv head in one decode program (a tile kept small)

__all__ = ["attention", "store_kv"]


def prepare(k_cache: torch.Tensor, num_q_heads: int) -> None:
    """Compiles, before the first request, every kernel variant `attention` can launch for
    this cache's layout (decode kernel: each tile height x each split count; prefill kernel:
    each query tile), so no request waits for Triton's compiler: an H200 stalled 0.5-1.6 s
    on each first use (docs/benchmarks_archive.md, "CUDA graphs for decode steps"). ~1 s a variant on a machine's
    first start; Triton's disk cache serves later starts."""
    if k_cache.device.type != "cuda":
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    like = dict(dtype=k_cache.dtype, device=k_cache.device)
    cache = torch.zeros(2, -(-64 // block_size), block_size, num_kv_heads, head_dim, **like)  # a throwaway cache
    decode_lens = decode_query_lens(num_q_heads // num_kv_heads)
    for q_len in sorted({*decode_lens, 16, 32, 64}):  # the prefill kernel's three query tiles too
        seq_len = max(q_len, 2)
        meta = AttentionMetadata.build([q_len], [seq_len], [list(range(-(-seq_len // block_size)))], block_size,
                                       device=k_cache.device)
        query = torch.zeros(q_len, num_q_heads, head_dim, **like)
        store_kv(query[:, :num_kv_heads], query[:, :num_kv_heads], cache[0], cache[1], meta.slot_mapping)
        if q_len in decode_lens:
            for splits in (1 << i for i in range(MAX_SPLITS.bit_length())):
                paged_decode_attention(query, cache[0], cache[1], meta, 1.0, num_splits=splits)
        if q_len in (16, 32, 64):
            paged_prefill_attention(query, cache[0], cache[1], meta, 1.0)
    torch.cuda.synchronize(k_cache.device)


def uses_decode_kernel(max_query_len: int, num_groups: int) -> bool:
    """Whether a step whose longest query is `max_query_len` tokens runs the decode kernel:
    decodes, and a draft's verification or a short prefill chunk that fits its tile."""
    return max_query_len <= MAX_QUERY_LEN and max_query_len * num_groups <= MAX_DECODE_ROWS


def decode_query_lens(num_groups: int) -> list[int]:
    """One query length for each tile height (`block_g`) the decode kernel can be launched with."""
    lens = {}
    for q_len in range(1, MAX_QUERY_LEN + 1):
        if q_len == 1 or uses_decode_kernel(q_len, num_groups):
            lens.setdefault(block_g(num_groups, q_len), q_len)
    return sorted(lens.values())


def attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              meta: AttentionMetadata, scale: float, window: int | None = None,
              softcap: float | None = None) -> torch.Tensor:
    """Causal paged attention over a mixed batch; see `AttentionMetadata` (a step with
    bidirectional ranges runs the prefill kernel); `window`, `softcap`: the layer's options.

    query [num_tokens, num_q_heads, head_dim] -> out of the same shape/dtype.
    """
    if meta.query_key_ends is None and (
            meta.is_decode_only or uses_decode_kernel(meta.max_seqlen_q, query.shape[1] // k_cache.shape[2])):
        return paged_decode_attention(query, k_cache, v_cache, meta, scale, window=window, softcap=softcap)
    return paged_prefill_attention(query, k_cache, v_cache, meta, scale, window=window, softcap=softcap)
