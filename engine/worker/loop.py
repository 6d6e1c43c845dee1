"""The prefill / decode / pd / aggregated worker loop around an `EngineCore`.

    loop:  drain inbox -> admit requests whose images are ready -> [threads from the
           host's core lease, transport/host/core_lease.py] -> engine.step()
           -> one TokenOutputs per API process with the step's outputs (and
              KVTransfer to decode, prefill role); with a stream interval N a
              request's tokens are held until N are here (the first and the last go at once)
           -> WorkerStats every `stats_interval_s`
           -> with --kv-events-config: the step's KV events, one EventBatch on a PUB
              socket (transport/wire/kv_event_publisher.py); replay requests answered
           -> with --router cache_aware: the same changes, one KVBlocks to every API
              process (its prefix index, epd/serve/prefix_index.py)

Roles:
  prefill     computes prompts, streams the first token, ships KV blocks to the
              decode worker named in the request, frees them on its KVAck.
  decode      takes KVTransfers, acks once the blocks are written, decodes.
  pd          prefill + decode in one engine (the e-pd mode).
  aggregated  pd + the vision encoder in-process (the baseline): EncodeRequests
              are encoded inline, between engine steps.
A request's images come from the engine (another request holds them), the
embedding cache (LMDB) or an EncodeDone; `ImageArrivals` keeps it until all
of them are here, then it enters the engine. With early prefill (the
default) it enters at once and is prefilled up to its first missing image;
the others follow it in with `EngineCore.add_embedding`, and the engine's
image ledger is then the only record of what it waits for: an image that
fails fails the requests waiting for it in the engine (`fail_image`) and
those held here; one that waited `EarlyPrefill.max_image_wait_s` is given up
on, in the engine (`abort_overdue`) and here (`ImageArrivals.expire`). Whether
early prefill is on and that bound are the engine's `EarlyPrefill`
(engine/early_prefill.py), asked here. The engine is reached only through
`EngineCore`'s verbs.

What the worker itself keeps for a request (its API process, its decode
worker, the KV it sent or received, the tokens it holds back) is one
`_RequestState`, made on arrival and dropped whole by `_forget` when the
request leaves: its last output, its KVAck (prefill role), an abort.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from epd.engine.engine_core import EngineCore, StepFailed
from epd.engine.early_prefill import gave_up_error
from epd.engine.worker.image_arrivals import Admit, Failed, ImageArrivals, Outcome
from epd.engine.worker.kv_handover import KVHandover
from epd.engine.request import Request
from epd.transport.wire.messages import (Abort, LoRAUpdate, EncodeDone, EncodeRequest, KVAck, KVBlocks, KVTransfer,
                                         Message, PrefillRequest, Shutdown, TokenOutput, TokenOutputs, WorkerStats)
from epd.transport.host.core_lease import CoreLease
from epd.transport.embedding_cache.mm_entry import MMEntry
from epd.transport.wire.wire_values import EncoderCounters, EngineCounters
from epd.transport.wire.frame_limits import encoder_inbox_frame_bytes, engine_inbox_frame_bytes
from epd.transport.wire.kv_event_publisher import KVEventPublisher
from epd.transport.wire.worker_io import WorkerIO, WorkerSpec

log = logging.getLogger("epd.worker")

MAX_ENDED = 4096  # ids of requests failed or aborted here, kept so their late EncodeDones keep nothing

# An in-process encoder (aggregated role): EncodeRequests -> for each, the (key, embeddings or error)
# pairs its spans wait for: an image's one under its mm_hash, a video's one per entry (its family's
# layout: one per temporal group, or one for the whole video), or one error for a video's first entry (epd/processes/worker_entry.py). It counts
# its decoding in the EncoderCounters it is given (frames and seconds, by modality).
EncodeFn = Callable[[list[EncodeRequest], EncoderCounters], list[list[tuple[str, MMEntry | str]]]]


def inbox_frame_bytes(core: EngineCore) -> int:
    """The largest frame this worker's inbox takes: a KVTransfer or an EncodeDone
    as large as a --max-model-len prompt (transport/wire/frame_limits.py)."""
    info, config = core.info, core.config
    return engine_inbox_frame_bytes(info.num_layers, info.num_kv_heads, info.head_dim, info.hidden_size,
                                    config.resolved_max_model_len(info.max_model_len), config.scheduler.block_size)


@dataclass(slots=True)
class _RequestState:
    """What the worker holds for one request, beside the engine and `ImageArrivals`.
    Made when the request arrives (a PrefillRequest, or a KVTransfer on a decode
    worker); dropped whole, by `_forget`, when the request leaves this worker:
    its last output sent, its KVAck received (prefill role), or aborted."""

    api_index: int | None = None  # several API processes: the one its outputs go to (None: the only one)
    decode_target: str | None = None  # prefill role: the decode worker its KV goes to, until sent
    transfer_start_s: float | None = None  # prefill role: KV sent at (perf_counter), until its KVAck
    transfer: KVTransfer | None = None  # decode role: KV arrived, waiting for free blocks
    held: TokenOutput | None = None  # stream interval: tokens not sent yet


class EngineWorker(KVHandover, WorkerIO):
    def __init__(self, spec: WorkerSpec, core: EngineCore, encode_fn: EncodeFn | None = None,
                 cores: CoreLease | None = None):
        if not spec.role.holds_kv:
            raise ValueError(f"an engine worker cannot take the role '{spec.role}'")
        max_frame_bytes = max(inbox_frame_bytes(core), encoder_inbox_frame_bytes(spec.max_image_bytes)
                              if spec.role.encodes else 0)  # aggregated: images come in EncodeRequests
        super().__init__(spec, core.info.fingerprint, max_frame_bytes=max_frame_bytes)
        self.core = core
        self.encode_fn = encode_fn
        self.cores = cores  # threads taken before each step from the host's other engine workers (or None)
        self.arrivals = ImageArrivals(self._lookup_embedding,  # requests waiting for their images
                                      early=core.early_prefill.is_on)
        self.requests: dict[str, _RequestState] = {}  # by request id, in arrival order
        self._num_incoming = 0  # requests whose `transfer` waits for free blocks
        self.running = True
        self.counters = EngineCounters()  # the scheduler's own counters are copied in at each WorkerStats
        self.encoder_counters = EncoderCounters() if encode_fn is not None else None
        self._last_stats = 0.0
        self._ended: OrderedDict[str, None] = OrderedDict()  # failed or aborted here, newest last
        kv_events = core.config.kv_events_config
        self.kv_events = KVEventPublisher(kv_events) if kv_events is not None and kv_events.is_on else None
        self._num_kv_blocks_sent = 0  # KVBlocks batches sent (their `seq`), with spec.reports_kv_blocks

    # ------------------------------------------------------------------ loop

    def run(self) -> None:
        self.announce()
        try:
            while self.running:
                busy = self.core.has_unfinished() or self._num_incoming > 0
                self._drain(timeout_s=0.0 if busy else 0.05)
                self._admit_transfers()
                self._give_up_waiting()
                if self.core.has_unfinished():
                    if self.cores is not None:
                        self.cores.take()
                    self._step()
                    self._publish_kv_events()
                else:
                    self.core.trim_loras()  # runtime loads read ahead: --max-cpu-loras though no step runs
                    if self.cores is not None:
                        self.cores.release()
                self._maybe_send_stats()
                if self.kv_events is not None:
                    self.kv_events.serve_replays()
        finally:
            if self.cores is not None:
                self.cores.close()
            if self.kv_events is not None:
                self.kv_events.close()
            self.close()

    def _drain(self, timeout_s: float) -> None:
        for msg in self.inbox.drain(timeout_s, self.spec.worker_id):
            try:
                self._handle(msg)
            except Exception:  # one bad message must not take the worker down; it fails its request
                log.exception("%s: failed to handle %s", self.spec.worker_id, type(msg).__name__)
                request_id = getattr(msg, "request_id", None)
                if isinstance(request_id, str):
                    self._fail(request_id, f"internal error handling {type(msg).__name__}", is_internal=True)

    def _handle(self, msg: Message) -> None:
        if isinstance(msg, PrefillRequest):
            self._on_prefill_request(msg)
        elif isinstance(msg, EncodeDone):
            self._on_encode_done(msg)
        elif isinstance(msg, EncodeRequest) and self.encode_fn is not None:
            self._on_encode_request([msg])
        elif isinstance(msg, KVTransfer):
            self._on_kv_transfer(msg)
        elif isinstance(msg, KVAck):
            self._on_kv_ack(msg)
        elif isinstance(msg, Abort):
            self._abort(msg.request_ids + self._requests_of(msg.api_index))
        elif isinstance(msg, LoRAUpdate):
            self._on_lora_update(msg)
        elif isinstance(msg, Shutdown):
            self.running = False
        else:
            log.warning("%s: unexpected %s", self.spec.worker_id, type(msg).__name__)

    def _on_lora_update(self, msg: LoRAUpdate) -> None:
        """A runtime adapter load (read it ahead, off the step loop) or unload (forget it)."""
        try:
            if msg.is_load:
                self.core.prefetch_lora(msg.lora)  # a bad one fails its requests, as it would unannounced
            else:
                self.core.unload_lora(msg.lora)
        except ValueError as exc:
            log.warning("%s: %s", self.spec.worker_id, exc)

    # ---------------------------------------------------------- admission

    def _on_prefill_request(self, msg: PrefillRequest) -> None:
        state = self._track(msg.request_id, msg.api_index)  # first: a failure below is answered there too
        request = Request(msg.request_id, list(msg.prompt_token_ids), msg.sampling,
                          mm_spans=list(msg.mm_spans), eos_token_ids=tuple(msg.eos_token_ids),
                          lora_request=msg.lora)
        state.decode_target = msg.decode_worker or None
        self._settle(self.arrivals.add(request, time.monotonic()))

    def _lookup_embedding(self, mm_hash: str) -> MMEntry | None:
        """An image the engine holds already, or the embedding cache."""
        entry = self.core.get_embedding(mm_hash)
        if entry is None and self.cache is not None:
            entry = self.cache.get(mm_hash)
        return entry

    def _on_encode_done(self, msg: EncodeDone) -> None:
        # its request failed or was aborted here (a video's other chunk failed): serve whoever else
        # waits for the entry, keep nothing for a request to come
        ended = msg.request_id in self._ended
        if not msg.ok:
            if not ended:
                self._image_failed(msg.mm_hash, f"image could not be encoded: {msg.error}", msg.request_id)
            return
        if msg.embeddings is None:  # written to the cache we share with the encoder
            entry = self.arrivals.find(msg.mm_hash)
            if entry is None:
                if not ended:
                    self._image_failed(msg.mm_hash, "image embedding missing from the cache (evicted before use?)")
                return
        else:
            entry = MMEntry(msg.embeddings, dict(msg.extras), dict(msg.meta))
            if self.cache is not None:  # no shared cache dir: keep a copy in ours
                self.cache.put(msg.mm_hash, entry)
        self._image_arrived(msg.mm_hash, entry, keep=not ended)

    def _on_encode_request(self, msgs: list[EncodeRequest]) -> None:
        """Aggregated role: encode in-process, then proceed as if each entry's EncodeDone arrived."""
        msgs = [m for m in msgs if m.request_id not in self._ended]  # e.g. a video's chunk after one failed
        if not msgs:
            return
        start = time.perf_counter()
        results = self.encode_fn(msgs, self.encoder_counters)
        self.encoder_counters.encode_seconds_sum += time.perf_counter() - start
        for msg, pairs in zip(msgs, results):
            if any(isinstance(result, str) for _, result in pairs):
                self.encoder_counters.num_errors += 1
            else:
                self.encoder_counters.num_images += 1  # a video counts one, as on an encoder worker
                kind = "video" if msg.video is not None else "audio" if msg.audio_tokens else "image"
                self.encoder_counters.modality(kind).num_items += 1
            for key, result in pairs:
                if isinstance(result, str):
                    self._on_encode_done(EncodeDone(msg.request_id, key, ok=False, error=result))
                    continue
                if self.cache is not None:
                    self.cache.put(key, result)
                self._image_arrived(key, result)

    def _image_arrived(self, mm_hash: str, entry: MMEntry, keep: bool = True) -> None:
        """An image is here: the engine takes it if requests in it wait for it
        (early prefill), the requests held here that it completes enter the engine;
        `keep`: else kept for a request still to come."""
        is_taken = self.core.add_embedding(mm_hash, entry)
        self._settle(self.arrivals.arrived(mm_hash, entry, is_taken, keep=keep))

    def _ended_here(self, request_ids) -> None:
        """Remembers requests failed or aborted here (bounded), whose late EncodeDones keep nothing."""
        for request_id in request_ids:
            self._ended[request_id] = None
        while len(self._ended) > MAX_ENDED:
            self._ended.popitem(last=False)

    def _image_failed(self, mm_hash: str, error: str, request_id: str | None = None) -> None:
        """An image will not come: the requests waiting for it fail, in the engine
        (early prefill) and held here; `request_id`, the request its encode was
        for, fails on arrival when the failure overtook it."""
        in_engine = self.core.fail_image(mm_hash)
        for rid in in_engine:
            self._fail(rid, error)
        self._settle(self.arrivals.failed(mm_hash, error, None if request_id in in_engine else request_id))

    def _give_up_waiting(self) -> None:
        """Fails the requests that waited `EarlyPrefill.max_image_wait_s` for an image, in the engine and held here."""
        now_s, max_wait_s = time.monotonic(), self.core.early_prefill.max_image_wait_s
        for rid in self.core.abort_overdue(now_s, max_wait_s):
            self._fail(rid, gave_up_error(max_wait_s))
        self._settle(self.arrivals.expire(now_s, max_wait_s))

    def _settle(self, outcomes: list[Outcome]) -> None:
        """Admits the requests whose images are here (early: all at once),
        answers the requests whose image failed."""
        for outcome in outcomes:
            if isinstance(outcome, Failed):
                self._fail(outcome.request_id, outcome.error)
            else:
                self._admit(outcome)

    def _admit(self, admit: Admit) -> None:
        request_id = admit.request.request_id
        try:
            self.core.add_request(admit.request, admit.embeddings, admit.pending)
        except ValueError as exc:  # e.g. a prompt that cannot fit the KV cache
            self._fail(request_id, str(exc))
        except Exception:  # fails this request only; the others of `outcomes` still settle
            log.exception("%s: could not admit %s", self.spec.worker_id, request_id)
            self._fail(request_id, "internal error while admitting the request", is_internal=True)

    def _fail(self, request_id: str, error: str, is_internal: bool = False) -> None:
        """Answers the request with `error` and frees whatever it holds here
        (early prefill: blocks filled before an image failed)."""
        self._ended_here([request_id])
        self.arrivals.remove(request_id)
        self.core.abort([request_id])
        self._send_output(TokenOutput(request_id, [], finished=True, finish_reason="error", error=error,
                                      is_internal_error=is_internal))

    def _track(self, request_id: str, api_index: int) -> _RequestState:
        """The request's state, made on its arrival, with the API process that
        takes its outputs (several API processes only)."""
        state = self.requests.get(request_id)
        if state is None:
            state = self.requests[request_id] = _RequestState()
        if len(self.apis) == 1:
            return state
        if api_index >= len(self.apis):  # misconfigured: `epd worker --api` names fewer API processes
            log.warning("%s: request %s comes from API process %d, but --api names %d", self.spec.worker_id,
                        request_id, api_index, len(self.apis))
            return state
        state.api_index = api_index
        return state

    def _forget(self, request_id: str) -> _RequestState | None:
        """The one place a request's state leaves the worker (the engine and
        ImageArrivals free theirs on their own verbs)."""
        state = self.requests.pop(request_id, None)
        if state is not None and state.transfer is not None:
            self._num_incoming -= 1
        return state

    def _requests_of(self, api_index: int | None) -> list[str]:
        """The requests whose outputs go to API process `api_index` (none for None)."""
        if api_index is None:
            return []
        return [rid for rid, state in self.requests.items() if state.api_index == api_index]

    def _abort(self, request_ids: list[str]) -> None:
        self._ended_here(request_ids)
        ids = set(request_ids)
        aborted = {rid for rid in ids if self.arrivals.remove(rid)}  # still waiting for images
        for rid in ids:
            state = self._forget(rid)
            if state is not None and state.transfer is not None:  # KV not yet taken
                aborted.add(rid)
        aborted |= set(self.core.abort(request_ids))
        self.counters.num_aborted += len(aborted)

    # ------------------------------------------------------------------ step

    def _step(self) -> None:
        try:
            result = self.core.step()
        except StepFailed as exc:  # those requests fail (the API may retry them elsewhere); we serve on
            log.exception("%s: a step failed; failing its %d requests", self.spec.worker_id,
                          len(exc.request_ids))
            for request_id in exc.request_ids:
                self._send_output(TokenOutput(request_id, [], finished=True, finish_reason="error",
                                              error="internal error in the engine", is_internal_error=True))
            for request_id, error in exc.failed.items():
                self._fail(request_id, error)
            return
        for request_id, error in result.failed.items():  # e.g. a grammar this engine cannot compile
            self._fail(request_id, error)
        for request_id in result.dropped:  # out of KV blocks, its images elsewhere: the API sends it again
            self._fail(request_id, "no KV cache block left for it on this decode worker", is_internal=True)
        outputs, prefilled = [], []
        for update in result.updates:
            request = result.requests[update.request_id]
            lp = result.logprobs.get(update.request_id)
            out = self._hold(self.requests.get(update.request_id), TokenOutput(
                update.request_id, list(update.new_token_ids), finished=update.is_finished,
                finish_reason=update.finish_reason, num_prompt_tokens=request.num_prompt_tokens,
                num_cached_tokens=request.num_cached_tokens, logprobs=lp,
                index=request.num_output_tokens - len(update.new_token_ids),
                prompt_logprobs=result.prompt_logprobs.get(update.request_id)), request.sampling_params.stream_interval)
            if out is not None:
                outputs.append(out)
            if update.is_prefilled:
                prefilled.append(request)
        self._send_step_outputs(outputs)  # a finished request's state leaves with its last output
        for request in prefilled:  # after the step's first tokens: the client sees them before the KV moves
            try:
                self._send_kv(request)
            except Exception:  # one request fails (the API sends it again elsewhere); the worker serves on
                log.exception("%s: could not send the KV of %s", self.spec.worker_id, request.request_id)
                self._fail(request.request_id, "could not send the KV cache to the decode worker", is_internal=True)

    def _publish_kv_events(self) -> None:
        """The step's prefix-cache changes: one batch on the PUB socket (--kv-events-config) and one
        KVBlocks to every API process (`spec.reports_kv_blocks`); none when off or nothing changed."""
        if self.kv_events is None and not self.spec.reports_kv_blocks:
            return
        events = self.core.take_kv_events()
        if self.kv_events is not None:
            self.kv_events.publish(events)
        if self.spec.reports_kv_blocks and events:
            blocks = KVBlocks.of_events(self.spec.worker_id, self._num_kv_blocks_sent, events, self.session)
            self._num_kv_blocks_sent += 1
            for api in self.apis:
                self.outbox.send(api, blocks)

    def _hold(self, state: _RequestState | None, out: TokenOutput, stream_interval: int) -> TokenOutput | None:
        """`out` joined to what is held for its request: returned to be sent when
        due (the request's first token, `stream_interval` tokens gathered, or the
        last), else kept in `state` (None)."""
        held = None if state is None else state.held
        if held is not None:
            state.held = None
            held.token_ids += out.token_ids
            if held.logprobs is not None:
                held.logprobs += out.logprobs or []
            held.finished, held.finish_reason = out.finished, out.finish_reason
            out = held
        if out.finished or out.index == 0 or len(out.token_ids) >= stream_interval or state is None:
            return out
        state.held = out
        return None

    def _send_step_outputs(self, outputs: list[TokenOutput]) -> None:
        """A step's outputs, one TokenOutputs message per API process they go to."""
        by_api: dict[int, list[TokenOutput]] = {}
        for out in outputs:
            by_api.setdefault(self._api_of(out), []).append(out)
        for index, outs in by_api.items():
            self.outbox.send(self.apis[index], TokenOutputs(outs))

    def _send_output(self, out: TokenOutput) -> None:
        """One output outside a step's batch (an error): whatever its request held is dropped."""
        self.outbox.send(self.apis[self._api_of(out)], out)

    def _api_of(self, out: TokenOutput) -> int:
        """The API process `out` goes to. A request's last output forgets the
        request (and drops whatever it held)."""
        state = self._forget(out.request_id) if out.finished else self.requests.get(out.request_id)
        return 0 if state is None or state.api_index is None else state.api_index

    def _maybe_send_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_stats < self.spec.stats_interval_s:
            return
        self._last_stats = now
        stats = self.core.stats()
        self.counters.num_preemptions = stats["num_preemptions"]
        self.counters.prefix_cache_queries = stats["prefix_cache_queries"]
        self.counters.prefix_cache_hits = stats["prefix_cache_hits"]
        self.counters.spec_decode_num_drafts = stats["spec_decode_num_drafts"]
        self.counters.spec_decode_num_draft_tokens = stats["spec_decode_num_draft_tokens"]
        self.counters.spec_decode_num_accepted_tokens = stats["spec_decode_num_accepted_tokens"]
        self.counters.spec_decode_num_accepted_tokens_per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]
        self.counters.state_snapshots_saved = stats["state_snapshots_saved"]
        self.counters.state_snapshot_hits = stats["state_snapshot_hits"]
        self.publish(WorkerStats(
            self.spec.worker_id, self.spec.role, num_running=self.core.num_running,
            num_waiting=self.core.num_waiting + self.arrivals.num_pending + self._num_incoming,
            num_free_blocks=self.core.num_free_blocks(), num_total_blocks=self.core.num_blocks,
            queue_depth=self.arrivals.num_pending, engine=self.counters, encoder=self.encoder_counters,
            session=self.session, cache=None if self.cache is None else self.cache.faults(),
            lora=self.core.lora_state(), num_state_slots=self.core.num_state_slots,
            num_free_state_slots=self.core.num_free_state_slots()))
