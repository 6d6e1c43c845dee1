"""The FP8 KV cache format (`--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2`): quantize on store,
dequantize on read (docs/decisions/fp8-kv-cache.md).

A packed cache is [num_blocks, block_size, num_kv_heads, head_dim + SCALE_BYTES] of the fp8
dtype: each (token, kv head) row holds head_dim fp8 values, then the bytes of one float32
scale, amax(|row|) / the format's largest value. A row's own scale never saturates (vLLM's
per-layer 1.0 clips K past 448 in e4m3) and follows no calibration, so every family's K and V
fit whatever their range; the scale travels with its row, so the prefix cache and the
prefill -> decode hand-over move blocks as they are.
"""
from __future__ import annotations

import torch

FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FORMATS = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_BYTES = 4  # one float32 scale after each row's head_dim values


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element dtype: the model's for auto, else the fp8 format named."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in FP8_DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto or one of {', '.join(FP8_DTYPES)}, got {kv_cache_dtype!r}")
    return FP8_DTYPES[kv_cache_dtype]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FORMATS

def kv_cache_dtype(config, model_dtype: torch.dtype, device: str) -> torch.dtype:
    """The KV cache's element dtype (an EngineConfig's --kv-cache-dtype); ValueError where the attention backend
    cannot read an fp8 cache (the Triton kernels do not yet: engine/attention/__init__.py)."""
    dtype = cache_dtype(config.kv_cache_dtype, model_dtype)
    backend = config.resolved_backend(device)
    if is_fp8(dtype) and backend != "torch":
        raise ValueError(f"--kv-cache-dtype {config.kv_cache_dtype} is served by the torch attention backend only "
                         f"(CPU, or --attention-backend torch on GPU), not by {backend}")
    return dtype



def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one (token, kv head) row of the cache: head_dim, plus the scale's bytes in fp8."""
    return head_dim + SCALE_BYTES if is_fp8(dtype) else head_dim


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., head_dim] (any float dtype) -> packed rows [..., head_dim + SCALE_BYTES] of `dtype`."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()  # [..., 1]
    scale = torch.where(amax > 0, amax / torch.finfo(dtype).max, torch.ones_like(amax))
    packed = torch.empty(*x.shape[:-1], x.shape[-1] + SCALE_BYTES, dtype=torch.uint8, device=x.device)
    packed[..., :x.shape[-1]] = (x.float() / scale).to(dtype).view(torch.uint8)
    packed[..., x.shape[-1]:] = scale.view(torch.uint8)
    return packed.view(dtype)


def dequantize(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed rows [..., head_dim + SCALE_BYTES] -> [..., head_dim] of `dtype`."""
    head_dim = packed.shape[-1] - SCALE_BYTES
    raw = packed.view(torch.uint8)
    scale = raw[..., head_dim:].contiguous().view(torch.float32)  # [..., 1]
    return (packed[..., :head_dim].float() * scale).to(dtype)

