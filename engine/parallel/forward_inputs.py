"""A forward's inputs as one `Step` (step_channel.py) and back: what a follower needs to run
the same forward as rank 0 on its own shard and its own KV cache."""
from __future__ import annotations

import torch

from epd.engine.attention.metadata import AttentionMetadata
from epd.engine.layers.forward_batch import ForwardBatch
from epd.engine.parallel.step_channel import Step

_META_TENSORS = ("slot_mapping", "cu_seqlens_q", "seq_lens", "block_tables")
_EXTRA = "mm_extras."


def forward_step(input_ids: torch.Tensor, batch: ForwardBatch) -> Step:
    """The step of one forward: token ids, positions, the attention metadata, the image rows."""
    meta: AttentionMetadata = batch.attn_meta
    tensors = {"input_ids": input_ids, "positions": batch.positions,
               **{name: getattr(meta, name) for name in _META_TENSORS}}
    if meta.query_key_ends is not None:
        tensors["query_key_ends"] = meta.query_key_ends
    if batch.mm_mask is not None:
        tensors["mm_mask"], tensors["mm_embeds"] = batch.mm_mask, batch.mm_embeds
        tensors.update({_EXTRA + name: t for name, t in batch.mm_extras.items()})
    values = {"max_seqlen_q": meta.max_seqlen_q, "max_seqlen_k": meta.max_seqlen_k,
              "is_decode_only": meta.is_decode_only,
              "bidirectional_ranges": [[list(r) for r in seq] for seq in meta.bidirectional_ranges]}
    return Step("forward", values, tensors)


def forward_batch(step: Step, backend, kv_caches, device) -> tuple[torch.Tensor, ForwardBatch]:
    """`forward_step` read back: (input_ids, the batch over this rank's `kv_caches`)."""
    t = {name: x.to(device) for name, x in step.tensors.items()}
    v = step.values
    meta = AttentionMetadata(
        **{name: t[name] for name in _META_TENSORS}, max_seqlen_q=v["max_seqlen_q"], max_seqlen_k=v["max_seqlen_k"],
        is_decode_only=v["is_decode_only"],
        bidirectional_ranges=tuple(tuple(tuple(r) for r in seq) for seq in v["bidirectional_ranges"]),
        query_key_ends=t.get("query_key_ends"))
    batch = ForwardBatch(positions=t["positions"], attn_meta=meta, backend=backend, kv_caches=kv_caches,
                         mm_mask=t.get("mm_mask"), mm_embeds=t.get("mm_embeds"),
                         mm_extras={name[len(_EXTRA):]: x for name, x in t.items() if name.startswith(_EXTRA)})
    return t["input_ids"], batch
