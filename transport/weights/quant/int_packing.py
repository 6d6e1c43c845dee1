"""4-bit integers packed eight to an int32, as the release formats pack them.

Eight consecutive values along one dim share an int32; field i is bits 4i..4i+3.
compressed-tensors (`pack_to_int32`) and GPTQ put value i in field i; AWQ's GEMM
layout puts values [0, 2, 4, 6, 1, 3, 5, 7] of each eight in fields 0..7
(`AWQ_ORDER`). Values are the unsigned fields, 0..15; a format's offset (8 for
compressed-tensors' signed int4) or zero point is its dequantizer's business.
"""
from __future__ import annotations

import torch

PACK = 8  # 4-bit fields per int32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # field i holds value AWQ_ORDER[i] of its eight


def pack_int4(values: torch.Tensor, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """values (0..15, any int dtype; size along `dim` a multiple of 8) -> int32, `dim` 8x shorter."""
    v = values.to(torch.int64).movedim(dim, -1)
    if v.shape[-1] % PACK:
        raise ValueError(f"cannot pack {v.shape[-1]} values along dim {dim}: not a multiple of {PACK}")
    if int(v.min()) < 0 or int(v.max()) > 15:
        raise ValueError("4-bit values must lie in 0..15")
    v = v.reshape(*v.shape[:-1], -1, PACK)  # [..., n / 8, 8]
    if order is not None:
        v = v[..., list(order)]
    packed = (v << (4 * torch.arange(PACK))).sum(-1)  # [..., n / 8], 0..2^32 - 1
    packed = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)
    return packed.movedim(-1, dim).contiguous()


def unpack_int4(packed: torch.Tensor, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """`pack_int4` backwards: int32 -> uint8 values 0..15, `dim` 8x longer."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed 4-bit values come as int32, not {packed.dtype}")
    p = packed.movedim(dim, -1).unsqueeze(-1)  # [..., n / 8, 1]
    fields = (p >> (4 * torch.arange(PACK, dtype=torch.int32))) & 15  # [..., n / 8, 8]
    if order is not None:
        fields = fields[..., [order.index(i) for i in range(PACK)]]
    return fields.reshape(*p.shape[:-2], -1).to(torch.uint8).movedim(-1, dim).contiguous()
