"""The prefill / decode / pd / aggregated worker loop around an `EngineCore`.

    loop:  drain inbox -> admit requests whose images are ready -> engine.step()
           -> TokenOutput to the API (and KVTransfer to decode, prefill role)
           -> WorkerStats every `stats_interval_s`

Roles:
  prefill     computes prompts, streams the first token, ships KV blocks to the
              decode worker named in the request, frees them on its KVAck.
  decode      takes KVTransfers, acks once the blocks are written, decodes.
  pd          prefill + decode in one engine (the e-pd mode).
  aggregated  pd + the vision encoder in-process (the baseline): EncodeRequests
              are encoded inline, between engine steps.
A request's images come from the embedding cache (LMDB) or with an EncodeDone;
it is admitted to the engine only once all of them are here.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable

import torch

from epd.engine.engine_core import EngineCore
from epd.engine.model_runner import MMEmbedding
from epd.engine.request import MMSpan, Request
from epd.transport.messages import (Abort, EncodeDone, EncodeRequest, KVAck, KVTransfer, Message,
                                PrefillRequest, Shutdown, TokenOutput, WorkerStats)
from epd.transport.messages import MMSpan as WireSpan
from epd.transport.mm_entry import MMEntry
from epd.transport.wire_values import EncoderCounters, EngineCounters
from epd.transport.worker_io import WorkerIO, WorkerSpec

if TYPE_CHECKING:
    from epd.encoders.image_encoder import ImageEmbedding

log = logging.getLogger("epd.worker")

MAX_EARLY_EMBEDDINGS = 256  # EncodeDones that arrived before their PrefillRequest

# An in-process encoder (aggregated role): raw images -> embeddings, or an error string per image.
EncodeFn = Callable[[list[bytes]], list["ImageEmbedding | str"]]


def to_wire_spans(spans: list[MMSpan]) -> list[WireSpan]:
    return [WireSpan(s.offset, s.length, s.mm_hash, tuple(s.grid_thw)) for s in spans]


def from_wire_spans(spans: list[WireSpan]) -> list[MMSpan]:
    return [MMSpan(s.offset, s.length, s.mm_hash, tuple(s.grid_thw)) for s in spans]


def to_embedding(embeddings: torch.Tensor, deepstack: list[torch.Tensor]) -> MMEmbedding:
    """Embeddings [n, hidden] + deepstack features (each [n, hidden]), as the runner takes them."""
    stacked = torch.stack(deepstack) if deepstack else embeddings.new_zeros(0, *embeddings.shape)
    return MMEmbedding(embeddings, stacked)


def _remember(bounded: OrderedDict, key: str, value) -> None:
    """Keeps `value` under `key`, forgetting the oldest entries past MAX_EARLY_EMBEDDINGS."""
    bounded[key] = value
    while len(bounded) > MAX_EARLY_EMBEDDINGS:
        bounded.popitem(last=False)


class EngineWorker(WorkerIO):
    def __init__(self, spec: WorkerSpec, core: EngineCore, encode_fn: EncodeFn | None = None):
        if not spec.role.holds_kv:
            raise ValueError(f"an engine worker cannot take the role '{spec.role}'")
        super().__init__(spec, core.info.fingerprint)
        self.core = core
        self.encode_fn = encode_fn
        self.pending: dict[str, tuple[Request, set[str]]] = {}  # waiting for images
        self.staged: dict[str, MMEmbedding] = {}  # images of pending requests, ready
        self.early: OrderedDict[str, MMEmbedding | None] = OrderedDict()  # EncodeDone before its request
        self.early_failures: OrderedDict[str, str] = OrderedDict()  # request id -> error, before its request
        self.decode_target: dict[str, str] = {}  # prefill role: request id -> decode worker address
        self.transfer_start: dict[str, float] = {}
        self.incoming: list[KVTransfer] = []  # decode role: waiting for free blocks
        self.running = True
        self.counters = EngineCounters()  # the scheduler's own counters are copied in at each WorkerStats
        self.encoder_counters = EncoderCounters() if encode_fn is not None else None
        self._last_stats = 0.0

    # ------------------------------------------------------------------ loop

    def run(self) -> None:
        self.announce()
        try:
            while self.running:
                busy = self.core.has_unfinished() or bool(self.incoming)
                self._drain(timeout_s=0.0 if busy else 0.05)
                self._admit_transfers()
                if self.core.has_unfinished():
                    self._step()
                self._maybe_send_stats()
        finally:
            self.close()

    def _drain(self, timeout_s: float) -> None:
        for msg in self.inbox.drain(timeout_s, self.spec.worker_id):
            try:
                self._handle(msg)
            except Exception:  # one bad message must not take the worker down
                log.exception("%s: failed to handle %s", self.spec.worker_id, type(msg).__name__)

    def _handle(self, msg: Message) -> None:
        if isinstance(msg, PrefillRequest):
            self._on_prefill_request(msg)
        elif isinstance(msg, EncodeDone):
            self._on_encode_done(msg)
        elif isinstance(msg, EncodeRequest) and self.encode_fn is not None:
            self._on_encode_request([msg])
        elif isinstance(msg, KVTransfer):
            self.incoming.append(msg)
        elif isinstance(msg, KVAck):
            self._on_kv_ack(msg)
        elif isinstance(msg, Abort):
            self._abort(msg.request_ids)
        elif isinstance(msg, Shutdown):
            self.running = False
        else:
            log.warning("%s: unexpected %s", self.spec.worker_id, type(msg).__name__)

    # ---------------------------------------------------------- admission

    def _on_prefill_request(self, msg: PrefillRequest) -> None:
        error = self.early_failures.pop(msg.request_id, None)
        if error is not None:  # one of its images failed before the request got here
            self._send_output(TokenOutput(msg.request_id, [], finished=True, finish_reason="error", error=error))
            return
        request = Request(msg.request_id, list(msg.prompt_token_ids), msg.sampling,
                          mm_spans=from_wire_spans(msg.mm_spans), eos_token_ids=tuple(msg.eos_token_ids))
        if msg.decode_worker:
            self.decode_target[msg.request_id] = msg.decode_worker
        missing = set()
        for mm_hash in {s.mm_hash for s in request.mm_spans}:
            if mm_hash in self.staged or mm_hash in self.core.runner.mm_embeddings:
                continue
            emb = self._from_cache_or_early(mm_hash)
            if emb is None:
                missing.add(mm_hash)
            else:
                self.staged[mm_hash] = emb
        self.pending[msg.request_id] = (request, missing)
        self._try_admit(msg.request_id)

    def _from_cache_or_early(self, mm_hash: str) -> MMEmbedding | None:
        emb = self.early.pop(mm_hash, None)
        if emb is not None:
            return emb
        if self.cache is not None:
            entry = self.cache.get(mm_hash)
            if entry is not None:
                return to_embedding(entry.embeddings, entry.deepstack)
        return None

    def _on_encode_done(self, msg: EncodeDone) -> None:
        if not msg.ok:
            error = f"image could not be encoded: {msg.error}"
            waiting = self._waiting_for(msg.mm_hash)
            for rid in waiting:
                self._fail(rid, error)
            if msg.request_id not in waiting:  # it overtook its PrefillRequest (ZeroMQ fair-queues the pipes)
                _remember(self.early_failures, msg.request_id, error)
            return
        if msg.embeddings is not None:
            emb = to_embedding(msg.embeddings, msg.deepstack)
            if self.cache is not None:  # no shared cache dir: keep a copy in ours
                self.cache.put(msg.mm_hash, MMEntry(msg.embeddings, list(msg.deepstack), msg.grid_thw or (1, 1, 1)))
        else:
            emb = self._from_cache_or_early(msg.mm_hash)
            if emb is None:
                for rid in self._waiting_for(msg.mm_hash):
                    self._fail(rid, "image embedding missing from the cache (evicted before use?)")
                return
        self._embedding_arrived(msg.mm_hash, emb)

    def _on_encode_request(self, msgs: list[EncodeRequest]) -> None:
        """Aggregated role: encode in-process, then proceed as if EncodeDone arrived."""
        start = time.perf_counter()
        results = self.encode_fn([m.image for m in msgs])
        self.encoder_counters.encode_seconds_sum += time.perf_counter() - start
        for msg, result in zip(msgs, results):
            if isinstance(result, str):
                self.encoder_counters.num_errors += 1
                self._on_encode_done(EncodeDone(msg.request_id, msg.mm_hash, ok=False, error=result))
                continue
            self.encoder_counters.num_images += 1
            if self.cache is not None:
                self.cache.put(msg.mm_hash, MMEntry(result.embeds, list(result.deepstack), result.grid_thw))
            self._embedding_arrived(msg.mm_hash, MMEmbedding(result.embeds, result.deepstack))

    def _waiting_for(self, mm_hash: str) -> list[str]:
        return [rid for rid, (_, missing) in self.pending.items() if mm_hash in missing]

    def _embedding_arrived(self, mm_hash: str, emb: MMEmbedding) -> None:
        """Admits the pending requests it completes; kept for a request still to come otherwise."""
        waiting = self._waiting_for(mm_hash)
        if not waiting:
            _remember(self.early, mm_hash, emb)
            return
        self.early.pop(mm_hash, None)
        self.staged[mm_hash] = emb
        for rid in waiting:
            self.pending[rid][1].discard(mm_hash)
            self._try_admit(rid)

    def _try_admit(self, request_id: str) -> None:
        request, missing = self.pending[request_id]
        if missing:
            return
        del self.pending[request_id]
        needed = {s.mm_hash for s in request.mm_spans}
        embeddings = {h: self.staged[h] for h in needed if h in self.staged}
        try:
            self.core.add_request(request, embeddings)
        except ValueError as exc:
            self._send_output(TokenOutput(request_id, [], finished=True, finish_reason="error", error=str(exc)))
        self._unstage(needed)

    def _unstage(self, mm_hashes) -> None:
        still_needed = {s.mm_hash for r, _ in self.pending.values() for s in r.mm_spans}
        for h in mm_hashes:
            if h not in still_needed:
                self.staged.pop(h, None)

    def _fail(self, request_id: str, error: str) -> None:
        request, _ = self.pending.pop(request_id, (None, None))
        if request is not None:
            self._unstage({s.mm_hash for s in request.mm_spans})
        self.decode_target.pop(request_id, None)
        self._send_output(TokenOutput(request_id, [], finished=True, finish_reason="error", error=error))

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if rid in self.pending:
                request, _ = self.pending.pop(rid)
                self._unstage({s.mm_hash for s in request.mm_spans})
            self.decode_target.pop(rid, None)
            self.transfer_start.pop(rid, None)
        self.incoming = [t for t in self.incoming if t.request_id not in set(request_ids)]
        self.core.abort(request_ids)

    # ------------------------------------------------------------- KV moves

    def _admit_transfers(self) -> None:
        """Decode role: write arrived KV into fresh blocks, then ack."""
        still_waiting = []
        for msg in self.incoming:
            request = Request(msg.request_id, list(msg.prompt_token_ids), msg.sampling,
                              mm_spans=from_wire_spans(msg.mm_spans), eos_token_ids=tuple(msg.eos_token_ids),
                              max_model_len=self.core.max_model_len)
            request.output_token_ids.append(msg.first_token_id)
            try:
                block_ids = self.core.scheduler.add_prefilled(request)
            except ValueError as exc:
                self.outbox.send(msg.reply_to, KVAck(msg.request_id, ok=False, error=str(exc)))
                self._send_output(TokenOutput(msg.request_id, [], finished=True, finish_reason="error",
                                              error=str(exc)))
                continue
            if block_ids is None:
                still_waiting.append(msg)  # no room yet; prefill keeps its copy meanwhile
                continue
            kv = self.core.runner.kv_cache  # [2, layers, blocks, block_size, kv_heads, head_dim]
            index = torch.tensor(block_ids, device=kv.device)
            kv[0][:, index] = msg.k_blocks[:, :len(block_ids)].to(kv.device, kv.dtype)
            kv[1][:, index] = msg.v_blocks[:, :len(block_ids)].to(kv.device, kv.dtype)
            self.counters.kv_transfer_bytes += msg.k_blocks.nbytes + msg.v_blocks.nbytes
            self.outbox.send(msg.reply_to, KVAck(msg.request_id, ok=True))
        self.incoming = still_waiting

    def _send_kv(self, request_id: str) -> None:
        """Prefill role: ship a prefilled request's blocks to its decode worker."""
        request = self.core.scheduler.get_request(request_id)
        target = self.decode_target.pop(request_id, None)
        if request is None or target is None:
            return
        kv = self.core.runner.kv_cache
        num_blocks = -(-request.num_prompt_tokens // self.core.config.scheduler.block_size)
        index = torch.tensor(request.block_ids[:num_blocks], device=kv.device)
        k, v = kv[0][:, index].cpu(), kv[1][:, index].cpu()  # [layers, blocks, block_size, kv_heads, head_dim]
        self.transfer_start[request_id] = time.perf_counter()
        self.outbox.send(target, KVTransfer(
            request_id, list(request.prompt_token_ids), request.output_token_ids[0],
            request.sampling_params, list(request.eos_token_ids), to_wire_spans(request.mm_spans),
            k, v, reply_to=self.inbox.address))

    def _on_kv_ack(self, msg: KVAck) -> None:
        start = self.transfer_start.pop(msg.request_id, None)
        if start is not None:
            self.counters.kv_transfer_seconds_sum += time.perf_counter() - start
            self.counters.num_kv_transfers += 1
        try:
            self.core.scheduler.release(msg.request_id)
        except ValueError:
            pass  # aborted meanwhile: already freed

    # ------------------------------------------------------------------ step

    def _step(self) -> None:
        result = self.core.step()
        for update in result.updates:
            request = result.requests[update.request_id]
            lp = result.logprobs.get(update.request_id)
            self._send_output(TokenOutput(
                update.request_id, list(update.new_token_ids), finished=update.is_finished,
                finish_reason=update.finish_reason, num_prompt_tokens=request.num_prompt_tokens,
                num_cached_tokens=request.num_cached_tokens, logprobs=None if lp is None else [lp],
                index=request.num_output_tokens - len(update.new_token_ids)))
            if update.is_prefilled:
                self._send_kv(update.request_id)
            elif update.is_finished:
                self.decode_target.pop(update.request_id, None)

    def _send_output(self, out: TokenOutput) -> None:
        self.outbox.send(self.spec.api, out)

    def _maybe_send_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_stats < self.spec.stats_interval_s:
            return
        self._last_stats = now
        stats = self.core.stats()
        self.counters.num_preemptions = stats["num_preemptions"]
        self.counters.prefix_cache_queries = stats["prefix_cache_queries"]
        self.counters.prefix_cache_hits = stats["prefix_cache_hits"]
        self.outbox.send(self.spec.api, WorkerStats(
            self.spec.worker_id, self.spec.role, num_running=self.core.scheduler.num_running,
            num_waiting=self.core.scheduler.num_waiting + len(self.pending) + len(self.incoming),
            num_free_blocks=self.core.num_free_blocks(), num_total_blocks=self.core.num_blocks,
            queue_depth=len(self.pending), engine=self.counters, encoder=self.encoder_counters))
