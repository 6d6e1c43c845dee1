"""ForwardBatch: what one forward pass needs besides token ids, passed explicitly."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardBatch:
    """Everything one forward pass needs besides token ids; passed explicitly.

    `backend` provides `store_kv(k, v, k_cache, v_cache, slot_mapping)` and
    `attention(q, k_cache, v_cache, meta, scale)`; `kv_caches[layer]` is that
    layer's `(k_cache, v_cache)`, each `[num_blocks, block_size, num_kv_heads, head_dim]`.
    """

    positions: torch.Tensor  # [position_dims, num_tokens]: the model's `positions` rule (models/positions.py)
    attn_meta: object
    backend: object
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    # Image embeddings for this step, if any token of the batch is an image placeholder.
    mm_mask: torch.Tensor | None = None  # [num_tokens] bool
    mm_embeds: torch.Tensor | None = None  # [num_mm_tokens, hidden]
    # the entries' named extras (MMEntry.extras), name -> [num_mm_tokens, ...]; Qwen3-VL's deepstack
    # features are "deepstack.0", "deepstack.1", ..., each [num_mm_tokens, hidden]
    mm_extras: dict[str, torch.Tensor] = field(default_factory=dict)
