"""EAGLE-3 speculation in the engine: the head's paged KV, its catch-up after every
target forward, its drafts before every schedule.

Head slot j of a request (the cache slot of its token j, in the request's own
blocks) holds the head's K/V for the input (the target's fused features at
position j - 1, the embedding of token j). That entry depends on tokens 0..j
only, exactly what the block hash of token j's block covers, so prefix caching
shares the head's entries with the target's, and a rejected draft leaves
nothing that a hash covers (as for the target). Slot 0 has no entry (no
features before token 0): the head's attention reads slots 1.. only.

    after each target forward (ModelRunner.execute -> catch_up)
        each request of the step: slots [start, c') get their entries, c' its new
        number of computed tokens (accepted ones only); the fused features of
        position c' - 1 are kept (`_last`), for the next slot.
    before each schedule (EngineCore._propose_drafts -> propose_requests)
        each decode whose features at num_computed - 1 are kept: slot num_computed
        (features c - 1, its last token) yields draft 1; draft i + 1 feeds the head's
        own hidden back with draft i. These entries are scratch (dense, dropped):
        the verification's accepted positions come back with the target's features.

A request whose kept features are not those of position start - 1 (a prefix-cache
hit, a recompute after preemption) gets one *lookbehind* row in the next target
forward: position start - 1 runs again, its KV not written (it is in the cache),
only for its aux states (`needs_lookbehind`). The head's positions (RoPE) are the
token indices. In e-p-d the prefill worker runs the catch-up and sends the head's
blocks and the kept features with the target's KV (`export`, `import_state`): the
decode worker drafts for its first step as an aggregated worker would.

Proposers share one interface with the n-gram one: `propose_requests(requests)`
-> one draft (a token list, maybe empty) per request, each of whose next step decodes.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from epd.engine.request import Request
from epd.engine.spec.eagle3 import Eagle3Config, Eagle3Head


@dataclass(frozen=True)
class CatchUp:
    """One request's share of a target forward, for the head: the batch rows of
    positions `first_position`.. (a lookbehind row first when first_position < start),
    the tokens known after the step (`token_ids`, sampled ones included) and
    `num_computed`, the target's computed tokens after the step (accepted only)."""

    request_id: str
    block_ids: Sequence[int]
    start: int
    first_position: int
    first_row: int
    num_computed: int
    token_ids: Sequence[int]


@dataclass
class _Kept:
    position: int
    features: torch.Tensor  # [hidden]: fc(aux states) at `position`


class Eagle3Proposer:
    def __init__(self, cfg: Eagle3Config, head: Eagle3Head, embed: torch.nn.Module, num_blocks: int,
                 block_size: int, num_speculative_tokens: int, device: torch.device, dtype: torch.dtype):
        self.cfg, self.head, self.embed = cfg, head, embed
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.device = device
        # [2 (k, v), head layers, num_blocks, block_size, kv heads, head_dim]: the target's block ids
        self.kv_cache = torch.zeros(2, cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                    dtype=dtype, device=device)
        self._kept: dict[str, _Kept] = {}

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return self.cfg.aux_layer_ids

    @staticmethod
    def bytes_per_block(cfg: Eagle3Config, block_size: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * element

    def drop(self, request_ids) -> None:
        for rid in request_ids:
            self._kept.pop(rid, None)

    def needs_lookbehind(self, request_id: str, start: int) -> bool:
        """Whether a chunk from `start` must also run position start - 1 (see the module doc)."""
        kept = self._kept.get(request_id)
        return start > 0 and (kept is None or kept.position != start - 1)

    # -- after the target's forward ------------------------------------------------

    @torch.inference_mode()
    def catch_up(self, chunks: Sequence[CatchUp], aux: Sequence[torch.Tensor]) -> None:
        """Writes the head's entries of slots [start, num_computed) of each chunk
        (`aux`: the target's states at the head's layers, [num_rows, target_hidden] each)
        and keeps each one's features of position num_computed - 1."""
        rows, spans = [], []
        for c in chunks:
            first = c.first_position
            rows += range(c.first_row, c.first_row + c.num_computed - first)  # positions first..c' - 1
            spans.append(c.num_computed - first)
        if not rows:
            return
        fused = self.head.combine([a[torch.tensor(rows, device=a.device)] for a in aux])  # [R, hidden]
        hidden, token_ids, slots, entries = [], [], [], []
        for c, f in zip(chunks, fused.split(spans)):
            features = {c.first_position + i: f[i] for i in range(len(f))}
            kept = self._kept.get(c.request_id)
            if kept is not None and kept.position == c.first_position - 1:
                features.setdefault(kept.position, kept.features)
            lo = max(c.start, 1)
            todo = [j for j in range(lo, c.num_computed) if j - 1 in features]
            hidden += [features[j - 1] for j in todo]
            token_ids += [c.token_ids[j] for j in todo]
            slots.append(todo)
            entries.append((c, todo))
            self._kept[c.request_id] = _Kept(c.num_computed - 1, f[-1].clone())
        if not token_ids:
            return
        positions = torch.tensor([j for todo in slots for j in todo], device=self.device)
        attend = _CatchUpAttention(self, entries)
        self.head(torch.stack(hidden), self.embed(torch.tensor(token_ids, device=self.device)), positions,
                  attend)

    # -- before the schedule ---------------------------------------------------------

    @torch.inference_mode()
    def propose_requests(self, requests: Sequence[Request]) -> list[list[int]]:
        """k greedy draft tokens per request whose features at num_computed - 1 are
        kept ([] for the others: their next forward looks behind, they draft after it)."""
        ready = [i for i, r in enumerate(requests)
                 if (kept := self._kept.get(r.request_id)) is not None
                 and kept.position == r.num_computed_tokens - 1 and r.num_tokens == r.num_computed_tokens + 1]
        drafts: list[list[int]] = [[] for _ in requests]
        if not ready:
            return drafts
        chosen = [requests[i] for i in ready]
        kv = _DraftAttention(self, chosen)
        hidden = torch.stack([self._kept[r.request_id].features for r in chosen])  # [B, hidden]
        token_ids = torch.tensor([r.all_token_ids[-1] for r in chosen], device=self.device)
        positions = torch.tensor([r.num_computed_tokens for r in chosen], device=self.device)
        out = []
        for _ in range(self.k):
            normed, hidden = self.head(hidden, self.embed(token_ids), positions, kv.attend)
            token_ids = self.head.compute_logits(normed).argmax(dim=-1)  # [B]
            out.append(token_ids)
            positions = positions + 1
        tokens = torch.stack(out, dim=1).tolist()  # [B, k]
        for i, draft in zip(ready, tokens):
            drafts[i] = draft
        return drafts

    # -- hand-over (e-p-d) -------------------------------------------------------------

    def export(self, request_id: str, block_ids: Sequence[int], num_prompt_tokens: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A prefilled request's head blocks (k, v: [head layers, blocks, block_size, kv heads,
        head_dim]) and its kept features of the last prompt position ([hidden]), on the CPU;
        None when not kept (it cannot draft at once on the decode worker)."""
        kept = self._kept.get(request_id)
        if kept is None or kept.position != num_prompt_tokens - 1:
            return None
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        return self.kv_cache[0][:, index].cpu(), self.kv_cache[1][:, index].cpu(), kept.features.cpu()

    def check_import(self, k_blocks: torch.Tensor, v_blocks: torch.Tensor, features: torch.Tensor,
                     num_blocks: int) -> None:
        """ValueError unless the head's blocks and features fit this head's cache."""
        _, layers, _, block_size, kv_heads, head_dim = self.kv_cache.shape
        want = (layers, block_size, kv_heads, head_dim)
        for name, t in (("draft k_blocks", k_blocks), ("draft v_blocks", v_blocks)):
            if t.ndim != 5 or t.shape[1] < num_blocks or (t.shape[0], *t.shape[2:]) != want:
                raise ValueError(f"{name} {list(t.shape)} do not fit this EAGLE-3 head's cache: want "
                                 f"[{layers}, >={num_blocks}, {block_size}, {kv_heads}, {head_dim}]")
        if tuple(features.shape) != (self.cfg.hidden_size,):
            raise ValueError(f"draft features {list(features.shape)} do not fit this EAGLE-3 head: "
                             f"want [{self.cfg.hidden_size}]")

    def import_state(self, request: Request, block_ids: Sequence[int], k_blocks: torch.Tensor,
                     v_blocks: torch.Tensor, features: torch.Tensor) -> None:
        """What `export` gave on the prefill worker, into this worker's blocks `block_ids`."""
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        n = len(block_ids)
        self.kv_cache[0][:, index] = k_blocks[:, :n].to(self.device, self.kv_cache.dtype)
        self.kv_cache[1][:, index] = v_blocks[:, :n].to(self.device, self.kv_cache.dtype)
        self._kept[request.request_id] = _Kept(request.num_prompt_tokens - 1,
                                               features.to(self.device, self.kv_cache.dtype))

    # -- the paged cache -----------------------------------------------------------------

    def gather(self, layer: int, block_ids: Sequence[int], end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of slots [1, end) of a request: [end - 1, kv heads, head_dim] each."""
        bs = self.block_size
        index = torch.tensor(list(block_ids[:-(-end // bs)]), dtype=torch.long, device=self.device)
        k = self.kv_cache[0, layer][index].flatten(0, 1)[1:end]
        v = self.kv_cache[1, layer][index].flatten(0, 1)[1:end]
        return k, v

    def store(self, layer: int, block_ids: Sequence[int], slots: Sequence[int], k: torch.Tensor,
              v: torch.Tensor) -> None:
        bs = self.block_size
        flat = torch.tensor([block_ids[j // bs] * bs + j % bs for j in slots], dtype=torch.long, device=self.device)
        self.kv_cache[0, layer].view(-1, *k.shape[1:]).index_copy_(0, flat, k.to(self.kv_cache.dtype))
        self.kv_cache[1, layer].view(-1, *v.shape[1:]).index_copy_(0, flat, v.to(self.kv_cache.dtype))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor) -> torch.Tensor:
    """q [B, M, Hq, D], k/v [B, T, Hkv, D], mask [B, M, T] (True: visible) -> [B, M, Hq, D]."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask[:, None], scale=scale)
    return o.transpose(1, 2)


class _CatchUpAttention:
    """The head's attention for a catch-up: each request's new entries see its slots
    [1, start) in the paged cache and, causally, each other; then they are stored.
    The catch-up's output is not used, only each layer's K/V: the last layer's
    attention is not computed (zeros)."""

    def __init__(self, proposer: Eagle3Proposer, entries: list[tuple[CatchUp, list[int]]]):
        self.proposer, self.entries = proposer, entries

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        is_last = layer == self.proposer.cfg.num_layers - 1
        out = torch.zeros_like(q) if is_last else torch.empty_like(q)
        row = 0
        for c, todo in self.entries:
            if not todo:
                continue
            m, lo = len(todo), todo[0]
            qs, ks, vs = q[row:row + m], k[row:row + m], v[row:row + m]
            if is_last:
                self.proposer.store(layer, c.block_ids, todo, ks, vs)
                row += m
                continue
            pk, pv = self.proposer.gather(layer, c.block_ids, lo)  # slots [1, lo)
            keys, values = torch.cat([pk, ks]), torch.cat([pv, vs])  # [lo - 1 + m, Hkv, D]
            visible = torch.arange(keys.shape[0], device=q.device)[None, :] <= \
                (lo - 1 + torch.arange(m, device=q.device))[:, None]  # [m, T]
            out[row:row + m] = _attend(qs[None], keys[None], values[None], scale, visible[None])[0]
            self.proposer.store(layer, c.block_ids, todo, ks, vs)
            row += m
        return out


class _DraftAttention:
    """The head's attention while drafting: one query a request per draft step over
    its slots [1, num_computed) (gathered once, padded) and the draft's scratch entries."""

    def __init__(self, proposer: Eagle3Proposer, requests: Sequence[Request]):
        lens = [r.num_computed_tokens - 1 for r in requests]  # slots 1..c-1
        longest = max(lens)
        self.k, self.v = [], []
        for layer in range(proposer.cfg.num_layers):
            ks, vs = [], []
            for r, n in zip(requests, lens):
                k, v = proposer.gather(layer, r.block_ids, n + 1)
                pad = longest - n
                ks.append(F.pad(k, (0, 0, 0, 0, 0, pad)))
                vs.append(F.pad(v, (0, 0, 0, 0, 0, pad)))
            self.k.append(torch.stack(ks))  # [B, longest, Hkv, D]
            self.v.append(torch.stack(vs))
        device = proposer.device
        self.mask = torch.arange(longest, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        self.k[layer] = torch.cat([self.k[layer], k[:, None]], dim=1)
        self.v[layer] = torch.cat([self.v[layer], v[:, None]], dim=1)
        if layer == 0:
            self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=1)
        return _attend(q[:, None], self.k[layer], self.v[layer], scale, self.mask[:, None])[:, 0]


def load_head(path: str, target_cfg, dtype: torch.dtype, device: torch.device) -> tuple[Eagle3Config, Eagle3Head]:
    """The head of `--speculative-config`'s "model", checked against the target (its
    hidden size, vocabulary and layers). ValueError names what does not fit."""
    from epd.engine.spec.eagle3 import load_eagle3

    try:
        cfg, head = load_eagle3(path, target_cfg.num_layers, dtype=dtype, device=device)
    except (OSError, KeyError) as exc:
        raise ValueError(f"--speculative-config: cannot read the EAGLE-3 head at {path}: {exc}") from None
    cfg.check_fits(path, target_cfg.hidden_size, target_cfg.vocab_size, target_cfg.num_layers)
    return cfg, head
