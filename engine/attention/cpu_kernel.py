"""The CPU paged decode attention kernel (paged_attention_cpu.c): built once, loaded with ctypes.

The torch backend's decodes gather every sequence's K and V out of its blocks
before SDPA reads them: on CPU that copy was a quarter of the decode worker's
time at 32 streams (docs/benchmarks_archive.md). The kernel reads K and V
in place through the block table. No library offers one for torch 2.13 on
CPU (vLLM's is compiled into vLLM; IPEX's stopped at older torch), so it is
ours: plain C with OpenMP, no torch headers, so it builds in about a second
with the system's C compiler on first use (transport/weights/c_library.py: cached under
a name that hashes the source, the flags and this CPU's features). Without a compiler (or with
`EPD_CPU_ATTENTION_KERNEL=0`) `load()` returns None and the torch backend
keeps its gather + SDPA path: same results, slower.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from epd.transport.weights import c_library

SOURCE = Path(__file__).with_name("paged_attention_cpu.c")
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_FP8_FORMATS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}  # the kernel's `fp8` (0: float32 caches)
_KERNEL = c_library.Kernel(
    SOURCE, "epd_paged_decode_attention",
    [_P, _P, _P, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, ctypes.c_float, ctypes.c_float, _P,
     ctypes.c_int, ctypes.c_int], ctypes.c_int,
    switch="EPD_CPU_ATTENTION_KERNEL", what="CPU attention kernel",
    fallback="CPU decode attention gathers K/V for SDPA")


def load():
    """The kernel's ctypes function, or None where it cannot be built (logged once)."""
    return _KERNEL.load()


def _load():
    """The kernel built now, not remembered (tests: the switch and the no-compiler case)."""
    return _KERNEL.build()


def decode_attention(fn, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_ids: torch.Tensor, scale: float,
                     out: torch.Tensor, window: int | None = None, softcap: float | None = None) -> None:
    """Writes `out`'s rows of the sequences `seq_ids` (int64); every tensor float32 / int32 on CPU and
    contiguous (`query` and `out` [num_tokens, Hq, D], caches [num_blocks, block_size, Hkv, D]), or the
    caches fp8 (engine/attention/fp8_kv.py's packed rows, [num_blocks, block_size, Hkv, D + SCALE_BYTES]).
    `window`, `softcap`: the layer's sliding window and attention logit soft-cap (None: off)."""
    num_q_heads, head_dim = query.shape[1:]
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    rc = fn(query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
            seq_lens.data_ptr(), cu_seqlens_q.data_ptr(), seq_ids.data_ptr(), seq_ids.numel(),
            num_q_heads, num_kv_heads, head_dim, block_size, window or 0, scale, softcap or 0.0, out.data_ptr(),
            torch.get_num_threads(), _FP8_FORMATS.get(k_cache.dtype, 0))
    if rc != 0:
        raise MemoryError("CPU attention kernel: no memory for its scores")

