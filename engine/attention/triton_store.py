"""Triton kernel that writes new tokens' K/V into the paged cache.

One program per token: load its [num_kv_heads, head_dim] key and value and
store them at `slot_mapping[t]` (skipped when the slot is < 0, i.e. padding).
Reference: `engine.attention.torch_attention.store_kv`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh,  # key [num_tokens, Hkv, D]
    stride_vt, stride_vh,  # value [num_tokens, Hkv, D]
    stride_kcb, stride_kcs, stride_kch,  # k_cache [num_blocks, block_size, Hkv, D]
    stride_vcb, stride_vcs, stride_vch,  # v_cache
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr,  # cache block (page) size
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)

    token = token.to(tl.int64)
    src_k = key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst_k = k_cache_ptr + block_id * stride_kcb + offset * stride_kcs + offs_h[:, None] * stride_kch
    dst_v = v_cache_ptr + block_id * stride_vcb + offset * stride_vcs + offs_h[:, None] * stride_vch
    dst_k += offs_d[None, :]
    dst_v += offs_d[None, :]
    tl.store(dst_k, tl.load(src_k, mask=mask), mask=mask)
    tl.store(dst_v, tl.load(src_v, mask=mask), mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Writes key/value [num_tokens, num_kv_heads, head_dim] at `slot_mapping`
    (int32/int64 [num_tokens]); slots < 0 are skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"key {tuple(key.shape)}, value {tuple(value.shape)} and slot_mapping "
                         f"{tuple(slot_mapping.shape)} disagree")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not fit key {tuple(key.shape)}")
    if not (key.dtype == value.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"dtype mismatch: key {key.dtype}, value {value.dtype}, cache {k_cache.dtype}")
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim")
    if num_tokens == 0:
        return
    block_size = k_cache.shape[1]
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads, head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
