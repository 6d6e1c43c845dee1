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
from epd.engine.attention.triton_decode import MAX_QUERY_LEN, paged_decode_attention
from epd.engine.attention.triton_prefill import paged_prefill_attention
from epd.engine.attention.triton_store import store_kv

MAX_DECODE_ROWS = 64  # query tokens x q heads of one kv head in one decode program (a tile kept small)

__all__ = ["attention", "store_kv"]


def prepare(device: torch.device, dtype: torch.dtype) -> None:
    """Nothing to do before the first step (the kernels compile on first use)."""


def attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal paged attention over a mixed batch; see `AttentionMetadata`.

    query [num_tokens, num_q_heads, head_dim] -> out of the same shape/dtype.
    """
    num_groups = query.shape[1] // k_cache.shape[2]
    is_verification = meta.max_seqlen_q <= MAX_QUERY_LEN and meta.max_seqlen_q * num_groups <= MAX_DECODE_ROWS
    if meta.is_decode_only or is_verification:
        return paged_decode_attention(query, k_cache, v_cache, meta, scale)
    return paged_prefill_attention(query, k_cache, v_cache, meta, scale)
