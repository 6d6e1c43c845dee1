"""The draft-model proposer: a small model with the target's tokenizer drafts k tokens.

    {"method": "draft_model", "model": DIR, "num_speculative_tokens": k}

The draft is the language model of any checkpoint the engine serves (a
Qwen3-VL, say, with fewer layers); it reads token ids only, never images:
an image's placeholder tokens are embedded as ordinary tokens, at the
target's positions (the target model's rule, engine/models/positions.py: text
after an image continues where the target's does). So a draft proposes the same way in every mode, and in e-p-d the
decode worker, which receives token ids and KV but no image embeddings,
needs nothing more. Its drafts are greedy (the draft's argmax): a point
mass, verified like n-gram drafts (greedy equality, or rejection sampling
for sampled requests).

**Its KV.** A paged cache of its own shapes, indexed by the *target's* block
ids (block b holds the target's K/V of those positions in the runner's cache
and the draft's here), plus a few scratch blocks per sequence for the draft's
positions past the blocks a request holds when it drafts. So it costs no
block accounting of its own: the KV budget counts both caches per block
(EngineCore), a finished or preempted request's blocks free both, and a
rejected token's slot is simply written again later. Each request's state
says how many of its positions have the draft's KV (`num_valid`):

    forward 1     tokens num_valid .. L - 1 (L = its tokens now; at least the last one):
                  in e-p-d the whole prompt and the first token the first time (the decode
                  worker runs the draft's prefill itself: the draft is small; sent chunked
                  within the step's token budget), else the tokens accepted since -> draft 1
    forward j     draft j - 1 at position L + j - 2 -> draft j   (j = 2..k)
    next step     num_valid = L + the number of its drafts the request now holds, at most
                  L + k - 1 (draft k is never fed) and never past its own blocks (scratch
                  slots are not kept)

A request's draft KV is a function of its tokens alone, so a block shared by
prefix caching gets the values its other holders wrote; a preempted request
(`num_preemptions` moved) starts again from position 0.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from epd.engine.attention import get_backend
from epd.engine.attention.metadata import AttentionMetadata
from epd.engine.kv_cache_sizer import bytes_per_block
from epd.engine.layers.forward_batch import ForwardBatch
from epd.engine.models.positions import PositionRule
from epd.engine.models.causal_lm import CausalLM
from epd.engine.request import Request


@dataclass
class _DraftState:
    request: Request
    num_preemptions: int  # the request's when this state began
    prompt_positions: torch.Tensor  # [position_dims, num_prompt_tokens] the target's positions
    delta: int  # position of token i >= num_prompt_tokens is i + delta
    num_valid: int = 0  # positions 0..num_valid - 1 hold the draft's KV
    num_tokens: int = 0  # the request's tokens when it last drafted
    draft: tuple[int, ...] = ()  # what it drafted then
    capacity: int = 0  # positions its own blocks held then (past them: scratch)


class DraftModelProposer:
    """Drafts for a step's decodes in one batch: one forward over what each has not
    seen yet, then one forward a draft token (`propose_requests`, the proposers' interface)."""

    def __init__(self, model: CausalLM, num_speculative_tokens: int, num_blocks: int, block_size: int,
                 attention_backend: str, device: str | torch.device, target_vocab_size: int, max_num_seqs: int,
                 max_num_tokens: int, positions: PositionRule):
        """`num_blocks`: the target's (block ids are shared); `max_num_tokens`: tokens a
        forward may take (the scheduler's token budget: a long catch-up is chunked);
        `positions`: the target model's rule, which places the draft's tokens too (ValueError
        unless the draft's positions have as many rows)."""
        if model.positions is not None and model.positions.position_dims != positions.position_dims:
            raise ValueError(f"the draft model's positions have {model.positions.position_dims} rows, "
                             f"the target's {positions.position_dims}: a draft must place tokens as its target")
        self.model = model
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.device = torch.device(device)
        self.backend = get_backend(attention_backend)
        self.vocab_size = min(target_vocab_size, model.cfg.vocab_size)  # drafts are target ids
        self.max_num_tokens = max_num_tokens
        self.positions = positions
        cfg = model.cfg
        self.num_scratch = -(-num_speculative_tokens // block_size) + 1  # per sequence
        self.scratch_base = num_blocks
        self.max_num_seqs = max_num_seqs
        dtype = model.model.embed_tokens.weight.dtype
        # [2 (k, v), num_layers, num_blocks + scratch, block_size, num_kv_heads, head_dim]
        self.kv_cache = torch.zeros(2, cfg.num_layers, num_blocks + max_num_seqs * self.num_scratch, block_size,
                                    cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=self.device)
        self.kv_caches = [(self.kv_cache[0, i], self.kv_cache[1, i]) for i in range(cfg.num_layers)]
        self._states: dict[str, _DraftState] = {}

    @staticmethod
    def bytes_per_block(model: CausalLM, block_size: int) -> int:
        """The draft's K and V of one block (added to the target's when the budget is split)."""
        cfg = model.cfg
        return bytes_per_block(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size,
                               model.model.embed_tokens.weight.dtype)

    @torch.inference_mode()
    def propose_requests(self, ready: Sequence[Request]) -> list[list[int]]:
        """A draft for each request in `ready` (decodes of the coming step; [] where it
        gets none: no room left under max_tokens / max_model_len, or a catch-up that
        does not fit this step). The state of finished requests is dropped."""
        for rid in [rid for rid, state in self._states.items() if state.request.is_finished]:
            del self._states[rid]
        plans, budget = [], self.max_num_tokens
        for request in ready[:self.max_num_seqs]:
            k = self._room(request)
            if k == 0 or budget == 0:
                continue
            state = self._catch_up(request)
            start = min(state.num_valid, request.num_tokens - 1)
            end = min(request.num_tokens, start + budget)
            budget -= end - start
            plans.append((request, state, start, end, k if end == request.num_tokens else 0))
        drafts: dict[str, list[int]] = {}
        if plans:
            self._run(plans, drafts)
        return [drafts.get(r.request_id, []) for r in ready]

    def _room(self, request: Request) -> int:
        """Draft tokens worth proposing: the target keeps at most max_tokens and max_model_len."""
        room = min(self.k, request.max_tokens - request.num_output_tokens - 1)
        if request.max_model_len is not None:
            room = min(room, request.max_model_len - request.num_tokens - 1)
        return max(0, room)

    def _catch_up(self, request: Request) -> _DraftState:
        """The request's state, its valid KV counted from the tokens it holds now."""
        state = self._states.get(request.request_id)
        if state is None or state.num_preemptions != request.num_preemptions:
            positions, delta = self.positions.prompt_positions(request.num_prompt_tokens, request.mm_spans)
            state = _DraftState(request, request.num_preemptions, positions.to(self.device), delta)
            self._states[request.request_id] = state
        elif state.draft:
            held = _tokens(request, state.num_tokens, state.num_tokens + len(state.draft))
            accepted = sum(1 for _ in itertools.takewhile(lambda p: p[0] == p[1], zip(held, state.draft)))
            state.num_valid = min(state.num_tokens + accepted, state.num_tokens + len(state.draft) - 1,
                                  state.capacity)
            state.draft = ()
        state.num_valid = min(state.num_valid, len(request.block_ids) * self.block_size)
        return state

    def _run(self, plans, drafts: dict[str, list[int]]) -> None:
        """Forward 1 over each plan's tokens start..end, then one forward per draft position."""
        tables = [self._table(i, r, end + max(k - 1, 0)) for i, (r, _, _, end, k) in enumerate(plans)]
        token_ids, positions = [], []
        for request, state, start, end, _ in plans:
            token_ids += _tokens(request, start, end)
            positions.append(self._positions(request, state, start, end))
        q_lens = [end - start for _, _, start, end, _ in plans]
        hidden = self._forward(token_ids, torch.cat(positions, dim=1), q_lens,
                               [end for _, _, _, end, _ in plans], tables)
        last_rows = list(itertools.accumulate(q_lens))
        active = [i for i, plan in enumerate(plans) if plan[4] > 0]
        out: dict[int, list[int]] = {}
        if active:
            rows = torch.tensor([last_rows[i] - 1 for i in active], dtype=torch.long, device=self.device)
            out = {i: [t] for i, t in zip(active, self._argmax(hidden[rows]))}
        for j in range(1, max((plans[i][4] for i in active), default=0)):
            active = [i for i in active if plans[i][4] > j]
            pos = [plans[i][3] + j - 1 for i in active]  # draft j's position: L + j - 1
            hidden = self._forward([out[i][-1] for i in active], self._text_positions(plans, active, pos),
                                   [1] * len(active), [p + 1 for p in pos], [tables[i] for i in active])
            for i, t in zip(active, self._argmax(hidden)):
                out[i].append(t)
        for i, (request, state, start, end, k) in enumerate(plans):
            state.num_valid = min(end, len(request.block_ids) * self.block_size)
            state.num_tokens, state.capacity = end, len(request.block_ids) * self.block_size
            state.draft = tuple(out.get(i, ()))
            if k:
                drafts[request.request_id] = out[i]

    def _text_positions(self, plans, active: list[int], pos: list[int]) -> torch.Tensor:
        """[position_dims, len(active)] positions of the output tokens at request indices `pos`."""
        values = [p + plans[i][1].delta for i, p in zip(active, pos)]
        return self.positions.later(torch.tensor(values, dtype=torch.long, device=self.device))

    def _table(self, index: int, request: Request, num_positions: int) -> list[int]:
        """The request's blocks, then its scratch blocks up to `num_positions` positions."""
        own = list(request.block_ids)
        extra = -(-num_positions // self.block_size) - len(own)
        assert extra <= self.num_scratch, "a draft never runs more than k positions past the computed tokens"
        first = self.scratch_base + index * self.num_scratch
        return own + list(range(first, first + max(0, extra)))

    def _positions(self, request: Request, state: _DraftState, start: int, end: int) -> torch.Tensor:
        """[position_dims, end - start] the target's positions of tokens start..end."""
        return self.positions.between(state.prompt_positions, state.delta, request.num_prompt_tokens, start, end,
                                      self.device)

    def _forward(self, token_ids: list[int], positions: torch.Tensor, q_lens: list[int], seq_lens: list[int],
                 tables: list[list[int]]) -> torch.Tensor:
        meta = AttentionMetadata.build(q_lens, seq_lens, tables, self.block_size, device=self.device)
        batch = ForwardBatch(positions=positions, attn_meta=meta, backend=self.backend, kv_caches=self.kv_caches)
        return self.model(torch.tensor(token_ids, dtype=torch.long, device=self.device), batch)

    def _argmax(self, hidden: torch.Tensor) -> list[int]:
        """The draft's greedy token of each row, among the target's ids."""
        return self.model.compute_logits(hidden)[:, :self.vocab_size].argmax(dim=-1).tolist()


def _tokens(request: Request, start: int, end: int) -> list[int]:
    """The request's tokens start..end (prompt, then output) without joining the two lists."""
    num_prompt = request.num_prompt_tokens
    head = request.prompt_token_ids[start:min(end, num_prompt)] if start < num_prompt else []
    return head + request.output_token_ids[max(start - num_prompt, 0):max(end - num_prompt, 0)]


def load_draft_model(model_dir: str, target_tokenizer_dir: str, dtype: torch.dtype,
                     device: str | torch.device) -> CausalLM:
    """The draft's language model, after checking it is a family EPD serves and
    that its tokenizer is the target's (ValueError naming the difference)."""
    from transformers import AutoConfig

    from epd.engine.loader import load_language_model
    from epd.families.registry import check_family
    from epd.engine.layers.mlp import pack_cpu_linears

    from epd.engine.spec.check import check_same_vocab

    check_family(model_dir)  # UnsupportedModelError (a ValueError) names the families served
    check_same_vocab(target_tokenizer_dir, model_dir)
    model = load_language_model(model_dir, AutoConfig.from_pretrained(model_dir), dtype, device)
    pack_cpu_linears(model)  # as the target's: fused SwiGLU, packed linears
    return model
