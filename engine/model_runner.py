"""Turns one scheduler step into tensors, runs the language model, samples.

One flattened variable-length batch per step: every scheduled request
contributes its chunk of tokens (a prefill chunk or one decode token), with
its positions (the model's rule, engine/models/positions.py), cache slots and its block table. Image and video
placeholder tokens take their rows of the span's embeddings (a chunk may
start or end inside a span) and deepstack features; a model whose image
tokens see each other both ways (`bidirectional_mm`) gets each chunk's
spans as the attention metadata's bidirectional ranges (its scheduler then
never ends a chunk inside a span); logits are computed only for the rows that
sample, and for the prompt rows of a request that asked for prompt logprobs
(`_score_prompt`).

The runner owns the KV cache: `read_blocks` / `write_blocks` move whole
blocks in and out (KV transfer). For a model whose layers carry per-request
state it owns the state cache too (engine/state_cache.py): a slot per
running request, given at its first step, taken back when it finishes or is
preempted, rolled back to its last accepted token after a draft's verification,
and its snapshots for prefix hits (`SnapshotPool`: a slot copied into one after a
step, one copied into a resuming request's slot before it, as the scheduler's
output names them). Image embeddings it reads from the engine's `ImageLedger`,
which holds them while a request uses them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
from dataclasses import dataclass, field

import torch

from epd.engine.attention import fp8_kv, get_backend
from epd.engine.attention.metadata import AttentionMetadata
from epd.engine.cuda_graphs import DecodeGraphs
from epd.engine.image_ledger import ImageLedger
from epd.engine.layers import gated_delta_cpu
from epd.engine.layers.forward_batch import ForwardBatch
from epd.engine.lora.manager import LoRAManager
from epd.engine.models.causal_lm import CausalLM, num_kv_layers
from epd.engine.request import Request
from epd.engine.sampler import (Sampler, SamplingBatch, SamplingInput, gather_logprobs, is_greedy_params,
                                make_generator)
from epd.engine.spec.eagle3_proposer import CatchUp, Eagle3Proposer
from epd.engine.spec.verify import Draft, verify_drafts
from epd.engine.state_cache import SnapshotPool, StateCache, state_shapes
from epd.engine.structured_output import CompiledConstraints, GrammarState, allocate_bitmask
from epd.transport.wire.sampling import TokenLogprobs
from epd.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from epd.transport.embedding_cache.mm_entry import MMEntry

@dataclass
class RunnerOutput:
    """Per request that sampled: its new tokens (one, or a verified draft's accepted
    prefix and the target's token) and, when asked, one logprobs entry per token."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # a request's prompt logprobs (prompt tokens 1..n-1), with its first sampled token
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


_PROMPT_LOGITS_ROWS = 256  # prompt rows scored at once: [rows, vocab] float32 logits at a time


@dataclass
class _RunnerState:
    """The runner's own state of one request (the worker's is engine/worker/loop.py _RequestState)."""

    prompt_positions: torch.Tensor  # [position_dims, num_prompt_tokens]
    delta: int  # position of token i >= num_prompt_tokens is i + delta
    generator: torch.Generator | None
    prompt_logprobs: list[TokenLogprobs] | None = None  # gathered over the prefill chunks


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int,
                 image_token_id: int, images: ImageLedger,
                 attention_backend: str = "torch", device: str | torch.device = "cpu",
                 lora: LoRAManager | None = None, eagle3: Eagle3Proposer | None = None, num_state_slots: int = 0,
                 num_state_snapshots: int = 0, kv_dtype: torch.dtype | None = None):
        """`model.positions` places each request's tokens (engine/models/positions.py);
        `eagle3`: an EAGLE-3 head to feed after every forward (engine/spec/eagle3_proposer.py);
        `num_state_slots`: the state cache's slots, for a model that declares per-request state;
        `num_state_snapshots`: copies of them kept at block boundaries for prefix hits;
        `kv_dtype`: the KV cache's (None: the model's; fp8: engine/attention/fp8_kv.py's packed rows)."""
        self.model = model
        self.positions = model.positions
        self.bidirectional_mm = getattr(model, "bidirectional_mm", False)  # the model says (default False: causal only)
        self.eagle3 = eagle3
        self.lora = lora  # --enable-lora: the adapters' slots (None: the base model only)
        self.images = images  # the engine's: embeddings of the images its requests use
        self.block_size = block_size
        self.image_token_id = image_token_id
        self.device = torch.device(device)
        self.backend = get_backend(attention_backend)
        self.sampler = Sampler()
        cfg = model.cfg
        dtype = model.model.embed_tokens.weight.dtype
        num_layers = num_kv_layers(model)  # the layers that hold KV
        kv_dtype = kv_dtype or dtype
        # [2 (k, v), num_layers, num_blocks, block_size, num_kv_heads, head_dim (+ fp8's scale)], one allocation.
        self.kv_cache = torch.zeros(2, num_layers, num_blocks, block_size, cfg.num_kv_heads,
                                    fp8_kv.row_width(cfg.head_dim, kv_dtype), dtype=kv_dtype, device=self.device)
        self.kv_caches = [(self.kv_cache[0, i], self.kv_cache[1, i]) for i in range(num_layers)]
        self.backend.prepare(self.kv_caches[0][0], cfg.num_heads)
        shapes = state_shapes(model)
        self.state_cache = StateCache(shapes, num_state_slots, dtype, self.device) if shapes else None
        self.snapshots = SnapshotPool(self.state_cache, num_state_snapshots) \
            if shapes and num_state_snapshots else None
        if shapes and self.device.type == "cpu":  # the Gated DeltaNet kernel built before the first step
            gated_delta_cpu.load()
        self.graphs: DecodeGraphs | None = None  # CUDA graphs of decode steps (`capture_graphs`)
        self._states: dict[str, _RunnerState] = {}
        self._grammars: dict[str, GrammarState] = {}  # structured outputs: request id -> matcher
        self._bad_words: dict[str, list[list[int]]] = {}  # request id -> each bad word's token ids

    # -- KV blocks (transfer between workers) --------------------------------------

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        """(num_layers, block_size, num_kv_heads, head_dim) of one block's K (or V) as it is handed
        over: every K/V head of the model, also where this cache holds a tensor-parallel rank's; an
        fp8 cache's head_dim counts its scale's bytes (engine/attention/fp8_kv.py)."""
        _, num_layers, _, block_size, num_kv_heads, head_dim = self.kv_cache.shape
        return num_layers, block_size, getattr(self.model, "handover_kv_heads", num_kv_heads), head_dim

    def read_blocks(self, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of K and V of `block_ids`, in that order: each
        [num_layers, len(block_ids), block_size, num_kv_heads, head_dim]. A tensor-parallel
        model (engine/parallel/leader.py) gathers the other ranks' heads into them."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        raw = self.kv_cache.view(torch.uint8) if fp8_kv.is_fp8(self.kv_cache.dtype) else self.kv_cache
        k, v = raw[0][:, index].view(self.kv_cache.dtype), raw[1][:, index].view(self.kv_cache.dtype)
        return self.model.gather_kv(block_ids, k, v) if hasattr(self.model, "gather_kv") else (k, v)

    def write_blocks(self, block_ids: list[int], k_blocks: torch.Tensor, v_blocks: torch.Tensor) -> None:
        """Writes K/V (shaped as `read_blocks` returns them, at least len(block_ids)
        blocks; extra blocks are ignored) into `block_ids`, in order; a tensor-parallel
        model's ranks each keep their heads."""
        self.check_blocks(k_blocks, v_blocks, len(block_ids))
        num_blocks = len(block_ids)
        if hasattr(self.model, "scatter_kv"):
            k_blocks, v_blocks = self.model.scatter_kv(block_ids, k_blocks[:, :num_blocks], v_blocks[:, :num_blocks])
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        if fp8_kv.is_fp8(self.kv_cache.dtype):  # packed rows, copied as bytes (check_blocks: the same format)
            raw = self.kv_cache.view(torch.uint8)
            raw[0][:, index] = k_blocks[:, :num_blocks].to(self.device).view(torch.uint8)
            raw[1][:, index] = v_blocks[:, :num_blocks].to(self.device).view(torch.uint8)
            return
        self.kv_cache[0][:, index] = k_blocks[:, :num_blocks].to(self.device, self.kv_cache.dtype)
        self.kv_cache[1][:, index] = v_blocks[:, :num_blocks].to(self.device, self.kv_cache.dtype)

    def check_blocks(self, k_blocks: torch.Tensor, v_blocks: torch.Tensor, num_blocks: int) -> None:
        """ValueError unless K and V are [num_layers, >= num_blocks, block_size,
        num_kv_heads, head_dim] of this cache (e.g. a peer with another block size)."""
        num_layers, block_size, num_kv_heads, head_dim = self.block_shape
        fp8 = fp8_kv.is_fp8(self.kv_cache.dtype)
        for name, t in (("k_blocks", k_blocks), ("v_blocks", v_blocks)):
            if (fp8 or fp8_kv.is_fp8(t.dtype)) and t.dtype != self.kv_cache.dtype:
                raise ValueError(f"{name} are {t.dtype} but this KV cache holds {self.kv_cache.dtype} "
                                 "(--kv-cache-dtype differs between the workers)")
            if t.ndim != 5 or t.shape[1] < num_blocks \
                    or (t.shape[0], *t.shape[2:]) != (num_layers, block_size, num_kv_heads, head_dim):
                raise ValueError(f"{name} {list(t.shape)} do not fit this KV cache: want "
                                 f"[{num_layers}, >={num_blocks}, {block_size}, {num_kv_heads}, {head_dim}]")

    @torch.inference_mode()
    def capture_graphs(self, sizes: list[int], max_model_len: int) -> float:
        """CUDA graphs of the decode forward for `sizes` sequences (engine/cuda_graphs.py);
        the seconds it took. Decode-only steps without images or adapters replay them."""
        graphs = DecodeGraphs(self._decode_forward, -(-max_model_len // self.block_size), self.block_size,
                              self.device, self.positions.position_dims)
        seconds = graphs.capture(sizes)
        self.graphs = graphs
        return seconds

    def _decode_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                        meta: AttentionMetadata) -> torch.Tensor:
        batch = ForwardBatch(positions=positions, attn_meta=meta, backend=self.backend, kv_caches=self.kv_caches)
        return self.model(input_ids, batch)

    # -- per-request state -----------------------------------------------------

    def _state(self, request: Request) -> _RunnerState:
        state = self._states.get(request.request_id)
        if state is None:
            positions, delta = self.positions.prompt_positions(request.num_prompt_tokens, request.mm_spans)
            seed = request.sampling_params.seed
            generator = make_generator(seed, self.device) if seed is not None else None
            state = _RunnerState(positions.to(self.device), delta, generator)
            self._states[request.request_id] = state
        return state

    def drop(self, request_ids) -> None:
        if self.eagle3 is not None:
            self.eagle3.drop(request_ids)
        for rid in request_ids:
            self._states.pop(rid, None)
            self._grammars.pop(rid, None)
            self._bad_words.pop(rid, None)

    def free_states(self, request_ids) -> None:
        """Takes back the state slots of requests that left or were preempted (no state cache: nothing)."""
        if self.state_cache is not None:
            self.state_cache.free(request_ids)

    def check_state(self, state: dict[str, torch.Tensor]) -> None:
        """ValueError unless `state` is one request's named state of this model ({} for one with KV only)."""
        if self.state_cache is None:
            if state:
                raise ValueError(f"per-request state {sorted(state)[:4]} for a model whose layers carry none")
        elif not state:
            raise ValueError("no per-request state came with the KV, and this model's layers carry it")
        else:
            self.state_cache.check(state)

    def put_state(self, request_id: str, state: dict[str, torch.Tensor]) -> None:
        """A request prefilled elsewhere: its slot starts from `state` (engine/state_cache.py `put`)."""
        self.state_cache.put(request_id, state)

    def export_state(self, request_id: str) -> dict[str, torch.Tensor]:
        """A prefilled request's named state on the CPU, its slot taken back ({}: no state cache)."""
        return self.state_cache.export(request_id) if self.state_cache is not None else {}

    def add_constraints(self, request: Request, prepared: CompiledConstraints) -> None:
        """A request's compiled grammar and tokenized bad words (engine/structured_output.py);
        kept until it finishes, across preemptions."""
        if prepared.grammar is not None:
            stop_ids = list(request.eos_token_ids) + list(request.sampling_params.stop_token_ids)
            self._grammars[request.request_id] = GrammarState(prepared.grammar, stop_ids)
        if prepared.bad_words_token_ids:
            self._bad_words[request.request_id] = prepared.bad_words_token_ids

    # -- one step ----------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.drop(out.finished_request_ids)
        self.free_states([*out.finished_request_ids, *out.preempted_request_ids])  # before this step's take theirs
        if out.is_empty:
            return RunnerOutput()
        token_ids: list[int] = []
        positions: list[torch.Tensor] = []
        mm_mask: list[bool] = []
        mm_rows: list[tuple[MMEntry, int, int]] = []
        q_lens, seq_lens, block_tables, sample_rows, sampling, offsets = [], [], [], [], [], []
        ranges: list[tuple[tuple[int, int], ...]] = []  # per chunk, its spans' positions (bidirectional_mm)
        chunks = [self._forward_chunk(s) for s in out.scheduled]  # an EAGLE-3 lookbehind row first, maybe
        for s, f in zip(out.scheduled, chunks):
            req, state = s.request, self._state(s.request)
            offsets.append(len(token_ids) + s.start - f.start)  # the chunk's first row in the batch
            token_ids += f.token_ids
            positions.append(self._positions(req, state, f.start, f.end))
            chunk_mask = [False] * f.num_new_tokens
            for span, first, last in f.mm_slices():
                emb = self.images.get(span.mm_hash)
                if emb is None:
                    raise RuntimeError(f"request {req.request_id}: no embedding for image {span.mm_hash}")
                mm_rows.append((emb, span.first_row + first, span.first_row + last))  # the entry's rows
                begin = span.offset + first - f.start
                chunk_mask[begin:begin + last - first] = [True] * (last - first)
            mm_mask += chunk_mask
            if self.bidirectional_mm:
                ranges.append(tuple((span.offset, span.end) for span, _, _ in f.mm_slices()))
            q_lens.append(f.num_new_tokens)
            seq_lens.append(f.end)
            block_tables.append(req.block_ids)
            if s.is_last_chunk:  # the last token's row, and a draft's rows after it
                sample_rows += range(len(token_ids) - s.num_sample_rows, len(token_ids))
                sampling.append(s)

        meta = AttentionMetadata.build(q_lens, seq_lens, block_tables, self.block_size, device=self.device,
                                       bidirectional_ranges=ranges)
        for s, f, offset in zip(out.scheduled, chunks, offsets):
            if f.start < s.start:  # a lookbehind row: its K/V is in the cache already (maybe a shared block)
                meta.slot_mapping[offset - 1] = -1
        batch = ForwardBatch(positions=torch.cat(positions, dim=1), attn_meta=meta, backend=self.backend,
                             kv_caches=self.kv_caches)
        if self.state_cache is not None:
            batch.state_caches = self.state_cache.layers
            batch.state_slots = [self.state_cache.slot(s.request_id) for s in out.scheduled]
            batch.checkpoint_seqs = [b for b, s in enumerate(out.scheduled) if s.draft_token_ids]
            for s, slot in zip(out.scheduled, batch.state_slots):  # a prefix hit resumes from a snapshot
                if s.request_id in out.snapshots.restores:
                    self.snapshots.restore(out.snapshots.restores[s.request_id], slot)
        if mm_rows:
            batch.mm_mask = torch.tensor(mm_mask, dtype=torch.bool, device=self.device)
            batch.mm_embeds = torch.cat([e.embeddings[a:b] for e, a, b in mm_rows]).to(self.device)
            batch.mm_extras = {name: torch.cat([e.extras[name][a:b] for e, a, b in mm_rows]).to(self.device)
                               for name in mm_rows[0][0].extras}  # each [num_mm_tokens, ...]
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        with self._adapters(chunks, len(token_ids)):
            if self.graphs is not None and not mm_rows and self.graphs.fits(meta) \
                    and all(s.request.lora_key is None for s in chunks):
                hidden, aux = self.graphs.run(input_ids, batch.positions, meta), []
            elif self.eagle3 is None:
                hidden, aux = self.model(input_ids, batch), []  # [num_tokens, hidden]
            else:
                hidden, aux = self.model.forward_with_aux(input_ids, batch, self.eagle3.aux_layer_ids)
        for s, slot in zip(out.scheduled, batch.state_slots):  # the state at a block boundary, kept
            if s.request_id in out.snapshots.saves:
                self.snapshots.save(slot, out.snapshots.saves[s.request_id])
        self._score_prompt(out.scheduled, offsets, hidden)
        result = RunnerOutput()
        if sample_rows:
            logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
            result = self._sample(logits, sampling)
            for req in (s.request for s in sampling):
                state = self._states[req.request_id]
                if state.prompt_logprobs is not None and req.num_output_tokens == 0:
                    result.prompt_logprobs[req.request_id] = state.prompt_logprobs
                    state.prompt_logprobs = None
        if batch.checkpoint_seqs:
            self._roll_back_states(out.scheduled, batch, result)
        if self.eagle3 is not None:
            self.eagle3.catch_up([_catch_up(s, f, offset, result.sampled_token_ids.get(s.request_id, []))
                                  for s, f, offset in zip(out.scheduled, chunks, offsets)], aux)
        return result

    def _roll_back_states(self, scheduled: list[ScheduledRequest], batch: ForwardBatch, result: RunnerOutput) -> None:
        """A verified draft's state slot keeps the state after its last accepted token, not after
        the rejected ones the forward ran (its positions 0..d: the last token, then the d drafts)."""
        for row, b in enumerate(batch.checkpoint_seqs):
            s = scheduled[b]
            num_accepted = len(result.sampled_token_ids[s.request_id]) - 1
            if num_accepted < len(s.draft_token_ids):
                self.state_cache.roll_back(batch.state_slots[b], batch.state_checkpoints, row, num_accepted)

    def _forward_chunk(self, s: ScheduledRequest) -> ScheduledRequest:
        """The chunk the forward runs for `s`: `s` itself, or with position start - 1 before it when
        the EAGLE-3 head needs that position's features (`Eagle3Proposer.needs_lookbehind`) and its
        token's input is here (an image placeholder's embedding may not be: the head then skips a slot)
        and the model carries no per-request state (running it again would advance the state)."""
        if self.eagle3 is None or not self.eagle3.needs_lookbehind(s.request_id, s.start):
            return s
        if self.state_cache is not None:  # the position would pass the state again: the head skips a slot
            return s
        f = dataclasses.replace(s, start=s.start - 1, num_new_tokens=s.num_new_tokens + 1)
        if any(self.images.get(span.mm_hash) is None for span, _, _ in f.mm_slices()):
            return s
        return f

    def _adapters(self, scheduled, num_tokens: int):
        """The step's adapters in their slots and each token's slot, around the forward pass."""
        adapters = {s.request.lora_key: s.request.lora_request for s in scheduled if s.request.lora_key is not None}
        if not adapters:
            return contextlib.nullcontext()
        slots = self.lora.activate(adapters)
        token_slots: list[int] = []
        for s in scheduled:
            key = s.request.lora_key
            token_slots += [-1 if key is None else slots[key]] * s.num_new_tokens
        assert len(token_slots) == num_tokens
        return self.lora.applied(self.lora.rows(token_slots, self.device))

    def _score_prompt(self, scheduled, offsets: list[int], hidden: torch.Tensor) -> None:
        """vLLM's prompt logprobs: the logits at prompt position p score prompt token
        p + 1 (log-softmax of the raw logits, float32; its rank and the top k).
        Gathered chunk by chunk until the request's first token; a request that
        already sampled (decode, a recompute after preemption) is not scored again."""
        rows, targets, owners = [], [], []
        for s, offset in zip(scheduled, offsets):
            req = s.request
            if req.sampling_params.prompt_logprobs is None or req.num_output_tokens:
                continue
            state = self._states[req.request_id]
            if s.start == 0:
                state.prompt_logprobs = []
            for p in range(s.start, min(s.end, req.num_prompt_tokens - 1)):
                rows.append(offset + p - s.start)
                targets.append(req.prompt_token_ids[p + 1])
                owners.append((state, req.sampling_params.prompt_logprobs))
        for i in range(0, len(rows), _PROMPT_LOGITS_ROWS):
            part = slice(i, i + _PROMPT_LOGITS_ROWS)
            logits = self.model.compute_logits(hidden[torch.tensor(rows[part], device=self.device)])
            entries = gather_logprobs(logits, torch.tensor(targets[part], device=self.device),
                                      [k for _, k in owners[part]])
            for (state, _), entry in zip(owners[part], entries):
                state.prompt_logprobs.append(entry)

    def _positions(self, req: Request, state: _RunnerState, start: int, end: int) -> torch.Tensor:
        """[position_dims, end - start] positions of tokens start..end of the request."""
        return self.positions.between(state.prompt_positions, state.delta, req.num_prompt_tokens, start, end,
                                      self.device)

    def _sample(self, logits: torch.Tensor, scheduled: list[ScheduledRequest]) -> RunnerOutput:
        """logits [rows, vocab]: `num_sample_rows` rows per request, in order. A
        request with a draft has a row per draft prefix, each with what decoding
        one token at a time would see there (grammar mask, bans, penalties), and
        keeps the tokens `verify_drafts` accepts."""
        inputs = [row for s in scheduled for row in self._sampling_inputs(s)]
        batch = SamplingBatch.from_inputs(inputs, device=self.device)
        firsts = list(itertools.accumulate((s.num_sample_rows for s in scheduled), initial=0))
        drafts = [Draft(row, s.draft_token_ids, is_greedy=is_greedy_params(s.request.sampling_params))
                  for s, row in zip(scheduled, firsts) if s.draft_token_ids]
        if drafts:
            processed = self.sampler.process(logits, batch)
            # `choose` takes the rows without a draft only (a copy: it divides random rows in place);
            # a drafted request's tokens, and its generator's draws, are the verifier's
            plain = [row for s, row in zip(scheduled, firsts) if not s.draft_token_ids]
            row_tokens = [0] * len(inputs)  # a drafted row's token is set below from what it kept
            if plain:
                chosen = self.sampler.choose(processed[torch.tensor(plain, device=processed.device)],
                                             batch.choice_rows(plain)).tolist()
                for row, token in zip(plain, chosen):
                    row_tokens[row] = token
            verified = iter(verify_drafts(processed, drafts, batch))
            logprobs = None
        else:
            result = self.sampler(logits, batch)
            row_tokens, logprobs = result.token_ids.tolist(), result.logprobs
        per_request = [next(verified) if s.draft_token_ids else [row_tokens[row]] for s, row in zip(scheduled, firsts)]
        if drafts and batch.num_logprobs is not None:  # the target's logprobs of the tokens kept
            for tokens, row in zip(per_request, firsts):
                row_tokens[row:row + len(tokens)] = tokens
            logprobs = gather_logprobs(logits, torch.tensor(row_tokens, device=logits.device), batch.num_logprobs)
        out = RunnerOutput()
        for s, row, tokens in zip(scheduled, firsts, per_request):
            out.sampled_token_ids[s.request_id] = tokens
            if logprobs is not None and logprobs[row] is not None:
                out.logprobs[s.request_id] = logprobs[row:row + len(tokens)]
        return out

    def _sampling_inputs(self, s: ScheduledRequest) -> list[SamplingInput]:
        """One row per sampled position: the last token's, then one per draft token."""
        req, params = s.request, s.request.sampling_params
        num_rows = len(s.draft_token_ids) + 1
        grammar = self._grammars.get(req.request_id)
        bitmask = None
        if grammar is not None:  # catch up on tokens sampled since (or elsewhere), then mask
            bitmask = allocate_bitmask(num_rows, self.model.cfg.vocab_size)
            grammar.advance(req.output_token_ids)
            grammar.fill_draft_bitmasks(s.draft_token_ids, bitmask, 0)
        rows = []
        for i in range(num_rows):
            output = req.output_token_ids + list(s.draft_token_ids[:i]) if i else req.output_token_ids
            banned = ()
            if len(output) < params.min_tokens:
                banned = tuple(params.stop_token_ids) + (() if params.ignore_eos else req.eos_token_ids)
            if req.request_id in self._bad_words:
                banned += _bad_word_ends(self._bad_words[req.request_id], output)
            rows.append(SamplingInput(params=params, prompt_token_ids=req.prompt_token_ids, output_token_ids=output,
                                      generator=self._states[req.request_id].generator, banned_token_ids=banned,
                                      token_bitmask=None if bitmask is None else bitmask[i]))
        return rows


def _catch_up(s: ScheduledRequest, f: ScheduledRequest, offset: int, sampled: list[int]) -> CatchUp:
    """What the EAGLE-3 head reads of one request's rows (`offset`: the row of position s.start)."""
    num_rejected = len(s.draft_token_ids) + 1 - len(sampled) if s.draft_token_ids else 0
    return CatchUp(s.request_id, s.request.block_ids, s.start, f.start, offset - (s.start - f.start),
                   s.end - num_rejected, s.request.all_token_ids + list(sampled))


def _bad_word_ends(words: list[list[int]], output_token_ids: list[int]) -> tuple[int, ...]:
    """The last token of each bad word whose other tokens end the output (vLLM's rule)."""
    out = []
    for ids in words:
        prefix = ids[:-1]
        if not prefix or output_token_ids[len(output_token_ids) - len(prefix):] == prefix:
            out.append(ids[-1])
    return tuple(out)
