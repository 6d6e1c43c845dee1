"""Per-step attention metadata: where new K/V goes and what each query sees.

One `AttentionMetadata` describes one forward step over a flattened batch of
sequences (prefill chunks and decodes mixed, in any order). It is built once
per step by the model runner and passed, unchanged, to every layer.

Paged KV cache, per layer: `k_cache`, `v_cache` of shape
[num_blocks, block_size, num_kv_heads, head_dim]; token slot
`s = block_id * block_size + offset`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from epd.engine.attention.fp8_kv import FORMATS as FP8_DTYPES
from epd.engine.attention.fp8_kv import SCALE_BYTES as FP8_SCALE_BYTES

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs about the batch, on the model's device.

    Sequence b owns query rows `cu_seqlens_q[b] : cu_seqlens_q[b+1]` of the
    flattened batch (q_len_b of them). Its context after this step holds
    `seq_lens[b]` tokens: a cached prefix of `seq_lens[b] - q_len_b` tokens
    plus the q_len_b new ones. Query row j (0-based) of sequence b sits at
    absolute position `seq_lens[b] - q_len_b + j` and attends causally to keys
    0..that position, all read from the paged cache through
    `block_tables[b]` (so `store_kv` must run before `attention`).

    Two options of a layer narrow or widen that (the backend's `attention`
    takes them as arguments, and every backend applies them the same way):
    a sliding window W hides keys at or before `position - W` (query i sees
    keys j with i - W < j <= its last key); bidirectional ranges (below) let
    the tokens of one range see each other both ways, in every layer, the
    window still applied (the mask is AND(window, OR(causal,
    same image))).

    Fields:
      slot_mapping  [num_tokens] int64: cache slot of each new token's K/V;
                    a slot < 0 is padding and is not written.
      cu_seqlens_q  [num_seqs + 1] int32: prefix sums of query lengths.
      seq_lens      [num_seqs] int32: context length after this step (>= 1).
      block_tables  [num_seqs, max_num_blocks] int32: physical block ids,
                    padded with 0 past each sequence's last block.
      max_seqlen_q  max query length of the batch (host int: grid sizes).
      max_seqlen_k  max of `seq_lens` (host int).
      is_decode_only  every sequence has exactly one query token.
      bidirectional_ranges  per sequence, the [start, end) ranges of absolute
                    positions whose tokens see each other both ways (an
                    image's placeholder tokens, for a model that asks for it);
                    empty: causal only.
      query_key_ends  [num_tokens] int32, or None when no range widens a query
                    of this step: the end (exclusive) of the keys each query
                    row sees, its position + 1, or the end of the range that
                    holds it. Derived from `bidirectional_ranges` by `build`.
      plans         a backend's own per-step work derived from the fields above
                    (e.g. how the torch backend groups the sequences), made by
                    the first layer that needs it and reused by the others;
                    not part of the metadata's value.
    """

    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    is_decode_only: bool
    bidirectional_ranges: tuple[tuple[tuple[int, int], ...], ...] = ()
    query_key_ends: torch.Tensor | None = None
    plans: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @classmethod
    def build(cls, q_lens: Sequence[int], seq_lens: Sequence[int],
              block_tables: Sequence[Sequence[int]], block_size: int,
              device: torch.device | str = "cpu",
              bidirectional_ranges: Sequence[Sequence[tuple[int, int]]] = ()) -> AttentionMetadata:
        """Builds the tensors from host lists (one entry per sequence).

        `block_tables[b]` lists the physical blocks of sequence b in order and
        must cover `seq_lens[b]` tokens; the new tokens' slots are derived
        from it. Padding tokens (slot -1) are the runner's business: append
        them to `slot_mapping` yourself if a fixed token count is needed.
        `bidirectional_ranges[b]`: sequence b's ranges (sorted, disjoint; none: causal).
        """
        if not (len(q_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("q_lens, seq_lens and block_tables need one entry per sequence")
        slots: list[int] = []
        for q_len, seq_len, blocks in zip(q_lens, seq_lens, block_tables):
            if not 1 <= q_len <= seq_len:
                raise ValueError(f"need 1 <= q_len <= seq_len, got q_len={q_len} seq_len={seq_len}")
            if len(blocks) * block_size < seq_len:
                raise ValueError(f"{len(blocks)} blocks of {block_size} cannot hold {seq_len} tokens")
            for pos in range(seq_len - q_len, seq_len):
                slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        max_num_blocks = max((len(b) for b in block_tables), default=0)
        table = [list(b) + [0] * (max_num_blocks - len(b)) for b in block_tables]
        cu = [0]
        for q_len in q_lens:
            cu.append(cu[-1] + q_len)
        ranges = tuple(tuple((int(a), int(z)) for a, z in r) for r in bidirectional_ranges)
        if ranges and len(ranges) != len(q_lens):
            raise ValueError("bidirectional_ranges needs one entry per sequence")
        key_ends = _query_key_ends(q_lens, seq_lens, ranges)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
            block_tables=torch.tensor(table, dtype=torch.int32, device=device).view(len(q_lens), max_num_blocks),
            max_seqlen_q=max(q_lens, default=0),
            max_seqlen_k=max(seq_lens, default=0),
            is_decode_only=all(q == 1 for q in q_lens),
            bidirectional_ranges=ranges if any(ranges) else (),
            query_key_ends=None if key_ends is None else torch.tensor(key_ends, dtype=torch.int32, device=device),
        )


def _query_key_ends(q_lens: Sequence[int], seq_lens: Sequence[int],
                    ranges: tuple[tuple[tuple[int, int], ...], ...]) -> list[int] | None:
    """Each query row's key end (see `AttentionMetadata.query_key_ends`); None when every one is
    its position + 1 (no range widens a query of this step: the causal kernels serve it)."""
    ends: list[int] = []
    widened = False
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        first = seq_len - q_len
        row_ends = list(range(first + 1, seq_len + 1))
        for start, end in ranges[b] if ranges else ():
            if not 0 <= start < end:
                raise ValueError(f"bad bidirectional range [{start}, {end})")
            if end > seq_len and start < seq_len:
                raise ValueError(f"bidirectional range [{start}, {end}) runs past the context ({seq_len} tokens): "
                                 "a chunk must take a range whole")
            for pos in range(max(start, first), min(end, seq_len)):
                if end > pos + 1:
                    row_ends[pos - first] = end
                    widened = True
        ends += row_ends
    return ends if widened else None


def check_attention_inputs(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata) -> None:
    """Shape/dtype checks shared by the backends (no device sync)."""
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_q_heads, head_dim], got {tuple(query.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    is_fp8 = k_cache.dtype in FP8_DTYPES  # engine/attention/fp8_kv.py's packed rows
    if query.dtype not in SUPPORTED_DTYPES or v_cache.dtype != k_cache.dtype \
            or (k_cache.dtype != query.dtype and not is_fp8):
        raise ValueError(f"query/k_cache/v_cache dtypes must match and be one of {SUPPORTED_DTYPES} (or the caches "
                         f"fp8), got {query.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    num_q_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim + (FP8_SCALE_BYTES if is_fp8 else 0):
        raise ValueError(f"head_dim mismatch: query {head_dim}, cache {k_cache.shape[3]} ({k_cache.dtype})")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    num_seqs = meta.seq_lens.shape[0]
    if meta.cu_seqlens_q.shape != (num_seqs + 1,) or meta.block_tables.shape[0] != num_seqs:
        raise ValueError("cu_seqlens_q must be [num_seqs + 1] and block_tables [num_seqs, max_num_blocks]")
    if meta.block_tables.shape[1] * k_cache.shape[1] < meta.max_seqlen_k:
        raise ValueError(f"block_tables width {meta.block_tables.shape[1]} x block_size {k_cache.shape[1]} "
                         f"< max_seqlen_k {meta.max_seqlen_k}")


def check_options(window: int | None, softcap: float | None) -> None:
    """A layer's attention options, as every backend takes them."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive or None, got {softcap!r}")
