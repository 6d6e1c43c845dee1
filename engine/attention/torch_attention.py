"""Paged attention in plain torch: the reference and the CPU serving path.

Each sequence's K/V is gathered from its blocks and handed to
`scaled_dot_product_attention` (an fp8 cache's rows dequantized on the way:
engine/attention/fp8_kv.py). GQA folds the q heads of one kv head into the
query rows ([num_kv_heads, group * q_len, head_dim]) so K/V are never
repeated. Decodes of similar length are batched into one call with a
key-padding mask: one query token each, or (speculative decoding) the last
token and its draft, a few query tokens behind a cached prefix, batched with
others of the same count under a causal mask among them. Decode gathers copy
into buffers each thread keeps rather than a new tensor a call (a new 4 MiB
tensor a call was up to 2-5x slower in `python -m bench.dev.cpu_decode_attention`).
On CPU in float32 the decodes skip all of that: engine/attention/cpu_kernel.py's
C kernel reads their K/V in place through the block table (the gather path
stays for half precision, and where no C compiler built the kernel).
A layer's sliding window and the metadata's bidirectional ranges are explicit
masks (a prefill reads only from its first row's window on; a sequence with
a widened query row is attended as a prefill); a soft-cap computes the
scores in plain ops (SDPA has no soft-cap), the C kernel caps its own.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from epd.engine.attention import cpu_kernel, fp8_kv
from epd.engine.attention.metadata import AttentionMetadata, check_attention_inputs, check_options

# A decode batch pads every sequence to its longest one; start a new batch
# when a sequence is shorter than this fraction of that longest one.
_DECODE_BATCH_MIN_FILL = 0.5
# ... or when the batch's gathered K would pass this size (fewer, larger calls
# parallelize better; past a few MiB K and V no longer stay in the cache for
# the SDPA call). `python -m bench.dev.cpu_decode_attention` on a 2-core Xeon
# (L2 2 MiB a core), batches of 8-128 decodes of 20-2,000 tokens: 4 MiB
# 0.83-0.92x the time of 1 MiB on 2 threads, 0.91-1.12x on one; 16 MiB up to
# 1.6x slower on one.
_DECODE_BATCH_MAX_BYTES = 4 << 20
# Decode gather buffers larger than this are not kept between calls.
_MAX_KEPT_BUFFER_BYTES = 64 << 20
# Query rows of one SDPA call in a prefill behind a cached prefix (see _prefill_one).
_PREFIX_QUERY_ROWS = 256
# Most query tokens of a sequence batched as a decode (a draft's verification) behind a cached prefix.
_MAX_DECODE_QUERY_LEN = 16


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Writes key/value [num_tokens, num_kv_heads, head_dim] at `slot_mapping`;
    slots < 0 are padding and skipped. An fp8 cache gets them quantized (engine/attention/fp8_kv.py)."""
    if fp8_kv.is_fp8(k_cache.dtype):  # packed rows, copied as bytes (CPU index_copy_ has no fp8)
        key = fp8_kv.quantize(key, k_cache.dtype).view(torch.uint8)
        value = fp8_kv.quantize(value, v_cache.dtype).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    num_kv_heads, head_dim = k_cache.shape[2:]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, Hkv, D]
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.long)
    if slots.numel() and bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    k_flat.index_copy_(0, slots, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value.to(v_cache.dtype))


def attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              meta: AttentionMetadata, scale: float, window: int | None = None,
              softcap: float | None = None) -> torch.Tensor:
    """Causal paged attention over a mixed batch; see `AttentionMetadata` (its
    bidirectional ranges included). `window`: the layer's sliding window (a query
    at position i sees keys j > i - window); `softcap`: scores s become
    softcap * tanh(s / softcap) before the mask. None: off.

    query [num_tokens, num_q_heads, head_dim] -> out of the same shape/dtype.
    """
    check_attention_inputs(query, k_cache, v_cache, meta)
    check_options(window, softcap)
    kernel = _cpu_kernel(query, k_cache, v_cache)
    plan = _step_plan(meta, k_cache, query.shape[1] // k_cache.shape[2], kernel is not None, window)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    for b, q_start, q_end, seq_len, widened in plan.prefills:
        _prefill_one(query, k_cache, v_cache, meta, scale, out, b, q_start, q_end, seq_len, window, softcap,
                     plan.key_ends if widened else None)
    if plan.kernel_seqs is not None:
        cpu_kernel.decode_attention(kernel, query.contiguous(), k_cache, v_cache, meta.block_tables.contiguous(),
                                    meta.seq_lens.contiguous(), meta.cu_seqlens_q.contiguous(), plan.kernel_seqs,
                                    scale, out, window, softcap)
    for group in plan.decodes:
        _decode_group(query, k_cache, v_cache, scale, out, group, softcap)
    return out


def prepare(k_cache: torch.Tensor, num_q_heads: int) -> None:
    """Builds (or loads) the CPU kernel before the first step where it will serve: a first
    request does not wait for the compiler, and a missing one is reported at start-up."""
    if use_cpu_kernel and k_cache.device.type == "cpu" \
            and (k_cache.dtype == torch.float32 or fp8_kv.is_fp8(k_cache.dtype)):
        cpu_kernel.load()


# False: decodes gather K/V for SDPA on CPU too (the bench's side-by-side and the tests of both paths)
use_cpu_kernel = True


def _cpu_kernel(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor):
    """engine/attention/cpu_kernel.py's function where it applies (float32 on CPU, a float32 or fp8
    cache, built), else None."""
    if not (use_cpu_kernel and query.device.type == "cpu" and query.dtype == torch.float32
            and k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None
    return cpu_kernel.load()


@dataclass(frozen=True)
class _DecodeGroup:
    """Sequences attended in one SDPA call, each with `q_len` query tokens at the end of its context."""

    num_seqs: int
    q_len: int
    max_len: int
    rows: torch.Tensor  # [B * Q] their query rows, sequence-major
    block_ids: torch.Tensor  # [B, num_blocks] int64
    padding: torch.Tensor | None  # rows of the gathered [B * num_blocks * block_size] keys past each context
    mask: torch.Tensor | None  # [B, 1, G * Q, max_len] bool (True: attend), None when nothing is masked


@dataclass(frozen=True)
class _Plan:
    # (sequence, first query row, end row, context length, whether a bidirectional range widens a row)
    prefills: list[tuple[int, int, int, int, bool]]
    decodes: list[_DecodeGroup]  # batched for SDPA
    kernel_seqs: torch.Tensor | None = None  # [n] int64, longest first: decodes for the CPU kernel instead
    key_ends: list[int] | None = None  # meta.query_key_ends on the host (None: causal)


def _step_plan(meta: AttentionMetadata, k_cache: torch.Tensor, num_groups: int, kernel: bool,
               window: int | None = None) -> _Plan:
    """How this step's sequences are attended: the same for every layer of one window, so made once
    per window (in `meta.plans`)."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    key = ("torch", block_size, num_kv_heads * head_dim * k_cache.element_size(), num_groups, kernel, window)
    plan = meta.plans.get(key)
    if plan is None:
        plan = meta.plans[key] = _make_plan(meta, block_size, key[2], num_groups, k_cache.device,
                                            k_cache.shape[0] if kernel else None, window)
    return plan


def _make_plan(meta: AttentionMetadata, block_size: int, bytes_per_token: int, num_groups: int,
               device: torch.device, kernel_cache_blocks: int | None = None, window: int | None = None) -> _Plan:
    """`kernel_cache_blocks`: the cache's block count when the CPU kernel attends the decodes. A sequence
    with a query a bidirectional range widens is attended as a prefill (explicit masks)."""
    cu = meta.cu_seqlens_q.tolist()
    seq_lens = meta.seq_lens.tolist()
    key_ends = None if meta.query_key_ends is None else meta.query_key_ends.tolist()
    prefills, decodes = [], {}  # query tokens -> sequences batched as decodes
    for b in range(len(seq_lens)):
        q_len = cu[b + 1] - cu[b]
        widened = key_ends is not None and any(key_ends[cu[b] + j] != seq_lens[b] - q_len + j + 1
                                               for j in range(q_len))
        if not widened and (q_len == 1 or q_len < min(seq_lens[b], _MAX_DECODE_QUERY_LEN + 1)):
            decodes.setdefault(q_len, []).append(b)
        else:
            prefills.append((b, cu[b], cu[b + 1], seq_lens[b], widened))
    if kernel_cache_blocks is not None:
        seq_ids = sorted((b for ids in decodes.values() for b in ids), key=lambda b: -seq_lens[b])
        if seq_ids:  # the kernel reads blocks by these ids unchecked: one out of range would read outside the cache
            used = meta.block_tables[seq_ids]
            if int(used.min()) < 0 or int(used.max()) >= kernel_cache_blocks:
                raise ValueError(f"block table holds ids outside the cache's {kernel_cache_blocks} blocks")
        return _Plan(prefills, [], torch.tensor(seq_ids, dtype=torch.int64), key_ends)
    groups = [_decode_group_plan(meta, group, cu, seq_lens, q_len, block_size, num_groups, device, window)
              for q_len, seq_ids in decodes.items() for group in _group_decodes(seq_ids, seq_lens, bytes_per_token)]
    return _Plan(prefills, groups, None, key_ends)


def _decode_group_plan(meta, group, cu, seq_lens, q_len, block_size, num_groups, device, window) -> _DecodeGroup:
    rows = torch.tensor([cu[b] + j for b in group for j in range(q_len)], device=device)  # [B * Q]
    lens = [seq_lens[b] for b in group]
    max_len = max(lens)
    num_blocks = -(-max_len // block_size)
    block_ids = meta.block_tables[torch.tensor(group, device=device), :num_blocks].to(torch.long)
    padding = mask = None
    if min(lens) != max_len or q_len > 1 or window is not None:
        lens_t = torch.tensor(lens, device=device)
        keys = torch.arange(max_len, device=device)
        is_pad = keys[None, :] >= lens_t[:, None]  # [B, max_len]
        seq, key = is_pad.nonzero(as_tuple=True)
        padding = seq * (num_blocks * block_size) + key
        if q_len == 1 and window is None:
            mask = ~is_pad[:, None, None, :]  # [B, 1, 1, max_len]
        else:  # query j of sequence b sits at position len_b - Q + j and sees keys up to it (in its window)
            last = lens_t[:, None] - q_len + torch.arange(q_len, device=device)[None, :]  # [B, Q]
            visible = keys[None, None, :] <= last[:, :, None]  # [B, Q, max_len]
            if window is not None:
                visible &= keys[None, None, :] > last[:, :, None] - window
            mask = visible[:, None, None].expand(-1, 1, num_groups, -1, -1).reshape(len(group), 1, -1, max_len)
    return _DecodeGroup(len(group), q_len, max_len, rows, block_ids, padding, mask)


def _gather_kv(cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """[..., num_blocks] block ids -> [..., num_tokens, Hkv, D] cache rows in order, of `dtype`
    (an fp8 cache's rows dequantized)."""
    # index_select on [num_blocks, block_size*Hkv*D] rows: a plain row copy, several
    # times faster on CPU than advanced indexing of the 4-D cache.
    rows = torch.index_select(cache.view(cache.shape[0], -1), 0, block_ids.reshape(-1))
    blocks = rows.view(*block_ids.shape, *cache.shape[1:])  # [..., num_blocks, block_size, Hkv, D]
    tokens = blocks.flatten(-4, -3)[..., :num_tokens, :, :]
    return fp8_kv.dequantize(tokens, dtype) if fp8_kv.is_fp8(cache.dtype) else tokens


_buffers = threading.local()


def _gather_rows(cache: torch.Tensor, block_ids: torch.Tensor, slot: int) -> torch.Tensor:
    """`block_ids`' blocks of `cache` as [num_ids, block_size * Hkv * D] rows, in a
    buffer this thread keeps for `slot` (0: K, 1: V) and overwrites at its next call."""
    flat = cache.view(cache.shape[0], -1)
    num_ids, row = block_ids.numel(), flat.shape[1]
    if num_ids * row * flat.element_size() > _MAX_KEPT_BUFFER_BYTES:
        return torch.index_select(flat, 0, block_ids.reshape(-1))
    kept = getattr(_buffers, "by_key", None)
    if kept is None:
        kept = _buffers.by_key = {}
    # a buffer made under inference mode cannot be written outside it: one buffer per mode
    key = (slot, flat.dtype, flat.device, row, torch.is_inference_mode_enabled())
    buffer = kept.get(key)
    if buffer is None or buffer.shape[0] < num_ids:
        size = num_ids if buffer is None else max(num_ids, 2 * buffer.shape[0])
        size = min(size, max(num_ids, _MAX_KEPT_BUFFER_BYTES // (row * flat.element_size())))
        buffer = kept[key] = torch.empty(size, row, dtype=flat.dtype, device=flat.device)
    return torch.index_select(flat, 0, block_ids.reshape(-1), out=buffer[:num_ids])


def _prefill_one(query, k_cache, v_cache, meta, scale, out, b, q_start, q_end, seq_len, window, softcap,
                 key_ends) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], query.shape[2]
    block_size = k_cache.shape[1]
    q_len = q_end - q_start
    num_groups = query.shape[1] // num_kv_heads
    num_blocks = -(-seq_len // block_size)
    block_ids = meta.block_tables[b, :num_blocks].to(torch.long)
    k = _gather_kv(k_cache, block_ids, seq_len, query.dtype).transpose(0, 1)  # [Hkv, seq_len, D]
    v = _gather_kv(v_cache, block_ids, seq_len, query.dtype).transpose(0, 1)
    if q_len == seq_len and window is None and softcap is None and key_ends is None:
        # No cached prefix: plain causal attention, which SDPA runs without
        # materialising a mask (about twice as fast on CPU for long prompts).
        q = query[q_start:q_end].transpose(0, 1)  # [Hq, q_len, D]; q head h reads kv head h // G
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale,
                                           enable_gqa=num_groups > 1)[0]
        out[q_start:q_end] = o.transpose(0, 1)
        return
    # A cached prefix (or a window, a soft-cap, a bidirectional range): SDPA needs an explicit mask,
    # and a masked call computes every (query, key) pair, the hidden ones too. Rows of at most
    # _PREFIX_QUERY_ROWS queries, each against only the keys it can see, leave
    # out most of the hidden upper triangle (the 2,048-token chunk of an early
    # prefill behind 600 cached tokens: 0.55-0.75x the time of one masked call).
    q = query[q_start:q_end].view(q_len, num_kv_heads, num_groups, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, q_len, D]
    prefix_len = seq_len - q_len
    for i in range(0, q_len, _PREFIX_QUERY_ROWS):
        j = min(q_len, i + _PREFIX_QUERY_ROWS)
        positions = torch.arange(prefix_len + i, prefix_len + j, device=query.device)  # absolute query positions
        if key_ends is None:
            ends, end = positions + 1, prefix_len + j  # causal; `end`: keys the last of these rows sees
        else:
            ends = torch.tensor(key_ends[q_start + i:q_start + j], device=query.device)
            end = max(key_ends[q_start + i:q_start + j])
        start = 0 if window is None else max(0, prefix_len + i - window + 1)  # the first row's first key
        keys = torch.arange(start, end, device=query.device)
        mask = keys[None, :] < ends[:, None]  # [j - i, end - start]
        if window is not None:
            mask &= keys[None, :] > positions[:, None] - window
        mask = mask.repeat(num_groups, 1)  # [G*(j-i), end - start], row order matches rows
        rows = q[:, :, i:j].reshape(num_kv_heads, num_groups * (j - i), head_dim)  # [Hkv, G*(j-i), D]
        # 4-D inputs: the CPU flash kernel (3-D ones fall back to the slow math path)
        o = _attend(rows[None], k[None, :, start:end], v[None, :, start:end], mask, scale, softcap)[0]
        o = o.view(num_kv_heads, num_groups, j - i, head_dim).permute(2, 0, 1, 3)
        out[q_start + i:q_start + j] = o.reshape(j - i, -1, head_dim)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
            softcap: float | None) -> torch.Tensor:
    """SDPA of [B, H, rows, D] against [B, H, keys, D] under `mask` (True: attend); with a soft-cap,
    the same in plain ops (SDPA has none): transformers' order, capped scores then the mask."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [B, H, rows, keys]
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)


def _decode_group(query, k_cache, v_cache, scale, out, group: _DecodeGroup, softcap: float | None) -> None:
    """The sequences of `group`, each with `q_len` query tokens at the end of its context, in one call."""
    num_kv_heads, head_dim = k_cache.shape[2], query.shape[2]
    num_groups = query.shape[1] // num_kv_heads
    num_seqs, q_len = group.num_seqs, group.q_len
    k_rows = _gather_rows(k_cache, group.block_ids, 0)  # [B * num_blocks, block_size * Hkv * D], a copy
    v_rows = _gather_rows(v_cache, group.block_ids, 1)
    if fp8_kv.is_fp8(k_cache.dtype):  # packed rows -> [B * num_blocks, block_size * Hkv * D] of query's dtype
        k_rows = fp8_kv.dequantize(k_rows.view(-1, k_cache.shape[-1]), query.dtype).view(k_rows.shape[0], -1)
        v_rows = fp8_kv.dequantize(v_rows.view(-1, v_cache.shape[-1]), query.dtype).view(v_rows.shape[0], -1)
    if group.padding is not None:
        # padding rows are stale cache memory (maybe NaN): 0 * NaN would leak through
        # softmax, so zero them — only them (a full masked_fill cost a third of the call)
        k_rows.view(-1, num_kv_heads * head_dim).index_fill_(0, group.padding, 0)
        v_rows.view(-1, num_kv_heads * head_dim).index_fill_(0, group.padding, 0)
    k = k_rows.view(num_seqs, -1, num_kv_heads, head_dim)[:, :group.max_len]  # [B, max_len, Hkv, D]
    v = v_rows.view(num_seqs, -1, num_kv_heads, head_dim)[:, :group.max_len]
    # [B, Q, Hkv, G, D] -> [B, Hkv, G * Q, D]: q head h reads kv head h // G; rows in (g, j) order
    q = query[group.rows].view(num_seqs, q_len, num_kv_heads, num_groups, head_dim).permute(0, 2, 3, 1, 4) \
        .reshape(num_seqs, num_kv_heads, num_groups * q_len, head_dim)
    o = _attend(q, k.transpose(1, 2), v.transpose(1, 2), group.mask, scale, softcap)
    o = o.view(num_seqs, num_kv_heads, num_groups, q_len, head_dim).permute(0, 3, 1, 2, 4)  # [B, Q, Hkv, G, D]
    out[group.rows] = o.reshape(num_seqs * q_len, -1, head_dim)


def _group_decodes(seq_ids: list[int], seq_lens: list[int], bytes_per_token: int) -> list[list[int]]:
    """Splits decodes, longest first, into batches that waste at most half of
    their padded size and gather at most _DECODE_BATCH_MAX_BYTES of K."""
    groups: list[list[int]] = []
    for b in sorted(seq_ids, key=lambda i: -seq_lens[i]):
        if groups:
            longest = seq_lens[groups[-1][0]]
            fits = (len(groups[-1]) + 1) * longest * bytes_per_token <= _DECODE_BATCH_MAX_BYTES
            if fits and seq_lens[b] >= _DECODE_BATCH_MIN_FILL * longest:
                groups[-1].append(b)
                continue
        groups.append([b])
    return groups
