"""Non-causal attention within each segment of a packed sequence of patches
(an image, a video's temporal group, a window): `segment_attention`, the
cu_seqlens-style attention of every vision tower."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _equal_runs(seq_lens: list[int]) -> list[tuple[int, int]]:
    """Consecutive equal lengths as (length, count): [64, 64, 64, 40] -> [(64, 3), (40, 1)]."""
    runs: list[tuple[int, int]] = []
    for n in seq_lens:
        if runs and runs[-1][0] == n:
            runs[-1] = (n, runs[-1][1] + 1)
        else:
            runs.append((n, 1))
    return runs


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
    """Non-causal attention within each segment: q, k, v [n, H, D] with
    n = sum(seq_lens) -> [n, H, D].

    Each run of equal-length segments is one batched call on 4-D [B, H, len, D]
    views: torch's flash kernels (the CPU one; flash or memory-efficient on CUDA)
    need 4-D inputs and hold O(len) per head, where a 3-D call falls back to the
    math path and materialises the H x len x len scores, twice (one 24,128-patch
    group, 16 heads: 18.6 GB per copy in bfloat16).
    """
    heads, dim = q.shape[1:]
    outs = []
    runs = _equal_runs(seq_lens)
    splits = [n * count for n, count in runs]
    for (n, count), qi, ki, vi in zip(runs, q.split(splits), k.split(splits), v.split(splits)):
        qi, ki, vi = (x.view(count, n, heads, dim).transpose(1, 2) for x in (qi, ki, vi))  # [B, H, len, D]
        o = F.scaled_dot_product_attention(qi, ki, vi)
        outs.append(o.transpose(1, 2).reshape(n * count, heads, dim))
    return torch.cat(outs) if len(outs) > 1 else outs[0]
