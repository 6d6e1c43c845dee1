"""ForwardBatch: what one forward pass needs besides token ids, passed explicitly."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardBatch:
    """Everything one forward pass needs besides token ids; passed explicitly.

    `backend` provides `store_kv(k, v, k_cache, v_cache, slot_mapping)` and
    `attention(q, k_cache, v_cache, meta, scale)`; `kv_caches[i]` is the i-th KV-holding
    layer's `(k_cache, v_cache)`, each `[num_blocks, block_size, num_kv_heads, head_dim]` (every
    layer holds KV unless the model says otherwise: engine/models/causal_lm.py `num_kv_layers`).

    A model whose layers carry per-request state (a Gated DeltaNet layer: layers/gated_deltanet.py)
    reads `state_caches[i]`, its i-th such layer's `(conv_states, recurrent_states)`, each
    `[num_slots, ...]`, at the rows `state_slots[b]` of sequence b (the sequences in `attn_meta`'s
    order); a sequence whose context is all new this step (q_len == seq_len) starts from zeros.
    The sequences `checkpoint_seqs` verify a draft (speculative decoding): such a layer keeps their
    state after each of their positions but the last (the slot holds that one) in
    `state_checkpoints[i]`, (conv, recurrent) each `[len(checkpoint_seqs), longest draft, ...]`,
    so the runner can keep the accepted one.
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
    # Per-request state of the layers that carry it, and each sequence's slot in it.
    state_caches: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    state_slots: list[int] = field(default_factory=list)  # [num_seqs]
    checkpoint_seqs: list[int] = field(default_factory=list)  # sequences verifying a draft, by batch index
    # filled by the layers: state layer i -> (conv, recurrent) after each position of each checkpoint_seqs
    state_checkpoints: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
