"""Paged attention backends.

Both backends expose the same calls, made by the model runner: once, before its first step,
  prepare(k_cache, num_q_heads)   (one layer's cache: its device, dtype and layout)
and per layer:
  store_kv(key, value, k_cache, v_cache, slot_mapping)
  attention(query, k_cache, v_cache, meta, scale, window=None, softcap=None) -> out
(`window`: the layer's sliding window, `softcap`: its attention logit soft-cap; the
metadata's bidirectional ranges apply in every layer).
An fp8 cache (`--kv-cache-dtype fp8`) is quantized in `store_kv` and dequantized on read
by the torch backend (its gather path and the CPU kernel); triton refuses it.
`torch` is the reference and the CPU path; `triton` the GPU path (imported
lazily, so CPU-only installs and TRITON_INTERPRET set late both work).

    metadata.py          `AttentionMetadata`: where new K/V goes and what each query sees
    fp8_kv.py            the FP8 KV cache's packed rows (fp8 values + a scale per token and kv head)
    torch_attention.py   plain torch: the reference and the CPU serving path
    cpu_kernel.py        the CPU paged decode kernel (paged_attention_cpu.c), built once, loaded with ctypes
    triton_attention.py  the Triton backend: the GPU serving path
    triton_prefill.py    paged prefill attention (flash-attention style)
    triton_decode.py     paged decode attention (split-K)
    triton_store.py      writes new tokens' K/V into the paged cache
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from epd.engine.attention.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "BACKEND_NAMES", "get_backend"]

BACKEND_NAMES = ("torch", "triton")


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    prepare: Callable[[torch.Tensor, int], None]
    store_kv: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
    attention: Callable[..., torch.Tensor]  # (query, k_cache, v_cache, meta, scale, window=None, softcap=None)


def get_backend(name: str) -> AttentionBackend:
    """"torch" or "triton"."""
    if name == "torch":
        from epd.engine.attention import torch_attention as impl
    elif name == "triton":
        from epd.engine.attention import triton_attention as impl
    else:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {BACKEND_NAMES}")
    return AttentionBackend(name=name, prepare=impl.prepare, store_kv=impl.store_kv, attention=impl.attention)
