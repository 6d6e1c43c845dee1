"""The API process's side of a request: prompt, routing, fan-out, streaming back.

    generate(request):
      media -> raw bytes (never pixels): data:, file:// in a thread,   epd/inputs/media.py
               http(s):// fetched with httpx on the event loop
      header size -> mm_hash, in a thread                            encoders/image_io.py
      chat template + placeholder expansion                          epd/inputs/prompt.py
      route: prefill (or pd / aggregated) worker, decode worker      epd/serve/router.py
             (e-p-d: a short text-only prompt to a decode worker alone, which prefills it)
      embedding cache lookup
      PrefillRequest at once (the worker waits for its images), then
      misses -> EncodeRequest per image, to the encoder where it finishes first   epd/serve/encoder_router.py
      TokenOutputs from the collector -> detokenize, stop strings -> Delta
      closed early (client gone) or stopped by a stop string -> Abort to every worker involved

The collector socket receives everything workers send the API: Ready,
WorkerStats, Alive (a busy worker's heartbeat), TokenOutputs (one per engine step; TokenOutput for a lone error) (and, with several API processes, the launcher's
WorkerExited). API process `api_index` names itself in each PrefillRequest,
so the workers send that request's tokens to its collector.
"""
from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict
import logging
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import AsyncIterator

from epd.encoders.image_io import ImageError, read_image_size
from epd.detokenizer import IncrementalDetokenizer
from epd.engine.model_info import ModelInfo
from epd.config import ServeConfig
from epd.inputs.media import MediaError, MediaFetcher, image_part_source
from epd.inputs.model_files import ModelFiles
from epd.inputs.prompt import ImageRef, PromptBuilder, PromptTooLong, exceeds_tokens, image_parts
from epd.api.protocol import Delta, GenerateRequest, RequestError
from epd.serve.encoder_router import EncoderRouter
from epd.serve.router import LeastRequestsRouter, idle_prefill_workers, make_router
from epd.serve.worker_metrics import WorkerMetrics
from epd.serve.attempt import DEADLINE, Attempt, Lost, Retry
from epd.serve.registry import WorkerInfo, WorkerRegistry
from epd.serve.token_order import TokenOrder
from epd.transport.auth import API, COLLECTOR_DOMAIN, PlaneKeys
from epd.transport.channels import AsyncOutbox, AsyncReceiver
from epd.transport.messages import (Abort, Alive, EncodeRequest, PrefillRequest, Ready, Shutdown, TokenOutput,
                                    TokenOutputs, WireError, WorkerExited, WorkerStats)
from epd.transport.mm_cache import MMCache, mm_hash
from epd.transport.mm_span import MMSpan
from epd.transport.roles import Role

log = logging.getLogger("epd.api")

PREFILL_ROLES = tuple(role for role in Role if role.takes_prefill)
MAX_ATTEMPTS = 4  # tries of one request on different workers before it fails
NO_WORKER_POLL_S = 0.05  # while no live worker of a role exists, look again this often
HEARTBEAT_CHECK_S = 0.5
ROLE_DOWN_RETRY_AFTER_S = 10  # Retry-After of a 503 for a role that is down (the supervisor probes it again)
MAX_ABANDONED = 4096
DISPATCH_BURST = 512  # messages taken without yielding to the event loop, at most  # ids of abandoned tries whose late outputs are answered with Abort


@dataclass
class _Prepared:
    token_ids: list[int]
    mm_spans: list[MMSpan]
    images: dict[str, bytes]  # mm_hash -> raw bytes, distinct images
    num_patches: dict[str, int]  # mm_hash -> vision patches (the encoder's work)


class Orchestrator:
    def __init__(self, config: ServeConfig, collector_address: str, mm_cache_dir: str,
                 keys_dir: str | None = None, api_index: int = 0):
        """`mm_cache_dir`: the embedding cache the launcher's workers share
        (`--mm-cache-dir`, or one it made under its run dir). `keys_dir`: the
        worker-plane keys when the collector is on tcp (default `--worker-keys`).
        `api_index`: this API process's place among `--api-servers` (its
        collector's in WorkerSpec.apis)."""
        self.config = config
        self.mm_cache_dir = mm_cache_dir
        self.keys_dir = keys_dir or config.worker_keys
        # tokenizer, chat template, sampling defaults, image processor; CheckpointError names what is wrong
        self.files = ModelFiles.open(config.model, config.files)
        self.info = ModelInfo.from_pretrained(config.model, self.files.hf_config)
        self.tokenizer = self.files.tokenizer
        self.geometry = self.files.geometry  # None: text only (no preprocessor_config.json)
        self.prompts = PromptBuilder(self.tokenizer, self.geometry, self.info.image_token_id,
                                     self.files.chat_template and self.files.chat_template.text)
        self.processor_config = self.files.processor_config or {}
        self.media = MediaFetcher(config.media)
        self.model_name = config.model_name
        self.max_model_len = config.engine.resolved_max_model_len(self.info.max_model_len)
        self.vocab_size = self.info.vocab_size
        self.collector_address = collector_address
        self.api_index = api_index
        self.host = socket.gethostname()
        # a worker busy past the request timeout holds nothing that can still finish
        self.registry = WorkerRegistry(stuck_after_s=config.limits.request_timeout_s)
        self.metrics = WorkerMetrics(self.registry)
        self.prefill_router = make_router(config.router)
        self.decode_router = make_router(config.router if config.router != "prefix_hash" else "least_loaded")
        # text-only requests wait for no encoder: the least busy prefill worker starts them first
        self.text_prefill_router = LeastRequestsRouter() if config.router == "least_loaded" else self.prefill_router
        # conditional disaggregation: short text-only prompts go to the least busy decode worker
        self.local_prefill_router = LeastRequestsRouter() if config.router == "least_loaded" else self.decode_router
        self.max_local_prefill_tokens = config.engine.scheduler.max_local_prefill_tokens \
            if Role.DECODE in {role for role, _ in config.mode_roles()} else 0
        self.encoder_router = EncoderRouter(config.encoder_router)
        self.cache: MMCache | None = None
        self.attempts: dict[str, Attempt] = {}  # attempt id -> the try its TokenOutputs go to
        self._abandoned: OrderedDict[str, None] = OrderedDict()  # ids of tries given up (bounded)
        self._silent: set[str] = set()  # workers past the heartbeat timeout, already failed over
        self._refused: set[str] = set()  # worker ids whose takeover by another session was refused (logged once)
        self.num_active = 0  # sequences in generate()
        self.pending_image_bytes = 0  # raw image bytes of requests not yet prefilled
        self.draining = False  # SIGTERM: refuse new requests, let these finish
        self.required_roles = [role for role, _ in config.mode_roles()]
        # the roles every request ends on (decode, pd or aggregated): one down, nothing can be served
        self.final_roles = [role for role in self.required_roles if role not in (Role.ENCODER, Role.PREFILL)]
        self._receiver: AsyncReceiver | None = None
        self._outbox: AsyncOutbox | None = None
        self._tasks: list[asyncio.Task] = []

    # ---------------------------------------------------------- lifecycle

    async def start(self) -> None:
        keys = PlaneKeys.load(self.keys_dir, API) if self.keys_dir else None
        self._receiver = AsyncReceiver(self.collector_address, keys=keys, domain=COLLECTOR_DOMAIN)
        self._outbox = AsyncOutbox(keys=keys)
        self._tasks = [asyncio.create_task(self._dispatch()), asyncio.create_task(self._watch_heartbeats())]

    async def wait_for_workers(self, expected: int, timeout_s: float, alive=lambda: True) -> None:
        """Until `expected` workers sent Ready; raises if one died or time ran out."""
        deadline = time.monotonic() + timeout_s
        while len(self.registry.workers) < expected:
            if not alive():
                raise RuntimeError("a worker process exited during start-up (see its log above)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(self.registry.workers)} of {expected} workers ready "
                                   f"after {timeout_s:.0f} s")
            await asyncio.sleep(0.05)
        self._open_cache()
        # where every socket lives, for operators (and the garbage-frame tests)
        workers = sorted(self.registry.workers.values(), key=lambda w: w.worker_id)
        sockets = [f"api={self.collector_address}"] + [f"{w.worker_id}={w.inbox}" for w in workers]
        print(f"EPD sockets: {' '.join(sockets)}", flush=True)

    def _open_cache(self) -> None:
        if self.cache is None and (Path(self.mm_cache_dir) / "data.mdb").exists():
            self.cache = MMCache(self.mm_cache_dir, self.config.mm_cache_bytes, readonly=True,
                                 model_fingerprint=self.info.fingerprint)

    async def stop(self, shutdown_workers: bool = True) -> None:
        """`shutdown_workers`: False for one of several API processes (the launcher stops the workers)."""
        if self._outbox is not None and shutdown_workers:
            for w in list(self.registry.workers.values()):
                try:
                    await asyncio.wait_for(self._outbox.send(w.inbox, Shutdown()), 1.0)
                except (asyncio.TimeoutError, Exception):
                    log.warning("could not send Shutdown to %s", w.worker_id)
        for task in self._tasks:
            task.cancel()
        if self.cache is not None:
            self.cache.close()
        await self.media.aclose()
        await asyncio.sleep(0.05)  # let the Shutdowns leave
        if self._outbox is not None:
            self._outbox.close()
        if self._receiver is not None:
            self._receiver.close()

    async def _dispatch(self) -> None:
        """The collector's reader: no one message, however bad, ends it (every worker would go silent)."""
        while True:
            try:
                msg = await self._receiver.recv()
            except WireError as exc:
                log.warning("collector: dropped a malformed message: %s", exc)
                continue
            await self._handle(msg)
            for _ in range(DISPATCH_BURST):  # the rest of a burst (a step's outputs), without awaiting each
                try:
                    msg = self._receiver.recv_nowait()
                except WireError as exc:
                    log.warning("collector: dropped a malformed message: %s", exc)
                    continue
                if msg is None:
                    break
                await self._handle(msg)

    async def _handle(self, msg) -> None:
        try:
            await self._on_message(msg)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("collector: a %s failed; the collector reads on", type(msg).__name__)

    async def _on_message(self, msg) -> None:
        if isinstance(msg, TokenOutputs):  # one engine step's outputs
            attempts = self.attempts
            for out in msg.outputs:
                attempt = attempts.get(out.request_id)
                if attempt is not None:
                    attempt.queue.put_nowait(out)
                else:
                    await self._on_stray_output(out)
        elif isinstance(msg, TokenOutput):
            attempt = self.attempts.get(msg.request_id)
            if attempt is not None:
                attempt.queue.put_nowait(msg)
            else:
                await self._on_stray_output(msg)
        elif isinstance(msg, WorkerStats):
            self.registry.on_stats(msg)
            self._silent.discard(msg.worker_id)
        elif isinstance(msg, Alive):
            info = self.registry.on_alive(msg)
            if info is not None and not self.registry.is_stuck(info):  # a stuck one is failed over once
                self._silent.discard(msg.worker_id)
        elif isinstance(msg, Ready):
            known = self.registry.workers.get(msg.worker_id)
            info = self.registry.on_ready(msg)
            if info is None:  # a live worker holds the id under another session
                if msg.worker_id not in self._refused:
                    self._refused.add(msg.worker_id)
                    log.warning("refused a Ready for %s: a live worker holds that id (a second process, "
                                "or a forged message); logged once", msg.worker_id)
                return
            if info is not known:  # registered now; re-announcements of a live worker change nothing
                self._silent.discard(msg.worker_id)
                self.encoder_router.on_ready(msg.worker_id)
                log.info("worker %s (%s) ready at %s", info.worker_id, info.role, info.inbox)
                self._open_cache()
        elif isinstance(msg, WorkerExited):
            self.on_worker_exit(msg.worker_id, msg.exit_code, msg.restarting)

    async def _on_stray_output(self, out: TokenOutput) -> None:
        """An output no try waits for: a worker (perhaps restarted) running a try
        given up is told to drop it; anything else (a try ended) is ignored."""
        if out.request_id in self._abandoned:
            del self._abandoned[out.request_id]
            await self._abort_everywhere(out.request_id)

    # ------------------------------------------------------------- facade

    async def _abort_everywhere(self, attempt_id: str) -> None:
        for w in self.registry.live(*PREFILL_ROLES, Role.DECODE):
            try:
                await self._outbox.send(w.inbox, Abort([attempt_id]))
            except Exception:
                log.warning("could not send Abort to %s", w.worker_id)

    def missing_roles(self) -> list[str]:
        """The roles this mode needs that have no live worker now."""
        return self.registry.missing_roles(self.required_roles)

    def is_healthy(self) -> bool:
        return not self.missing_roles()

    def metrics_text(self) -> bytes:
        return self.metrics.render()

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # ------------------------------------------------------------ requests

    async def _load_images(self, req: GenerateRequest) -> list[bytes]:
        """Raw bytes of every image part, in order, fetched concurrently; RequestError
        for a refused one (the others are cancelled). The per-prompt image limit was
        checked by the API layer (protocol.validate_messages) before any fetch."""
        if req.messages is None:
            return []
        parts = image_parts(req.messages)
        if parts and self.files.no_images_reason:
            raise RequestError(status=400, message=self.files.no_images_reason, param="messages")
        loads = [asyncio.ensure_future(self.media.load(image_part_source(part))) for part in parts]
        try:
            return list(await asyncio.gather(*loads))
        except MediaError as exc:
            raise RequestError(status=400, message=str(exc), param="messages") from None
        finally:
            for load in loads:
                load.cancel()
            await asyncio.gather(*loads, return_exceptions=True)

    def _prepare(self, req: GenerateRequest, raw_images: list[bytes]) -> _Prepared:
        """Tokens, image spans and distinct images; RequestError for bad input."""
        max_prompt_tokens = self.max_model_len - 1  # one token at least is left to generate
        if req.messages is None:
            prompt = req.prompt
            if isinstance(prompt, str) and exceeds_tokens(self.tokenizer, prompt, max_prompt_tokens):
                raise self._too_long(PromptTooLong(f"the prompt has more than {max_prompt_tokens} tokens"), "prompt")
            ids = self.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else list(prompt)
            if not ids:
                raise RequestError(status=400, message="the prompt is empty", param="prompt")
            if any(not 0 <= t < self.info.vocab_size for t in ids):
                raise RequestError(status=400, message=f"token ids must be in [0, {self.info.vocab_size})", param="prompt")
            return _Prepared(ids, [], {}, {})
        images, num_patches, refs, num_pixels = {}, {}, [], 0
        for data in raw_images:
            try:
                width, height = read_image_size(data, self.config.media.max_image_pixels)
                t, h, w = self.geometry.grid_thw(width, height)  # refuses aspect ratios the processor refuses
            except (ImageError, ValueError) as exc:
                raise RequestError(status=400, message=str(exc), param="messages") from None
            num_pixels += width * height
            if num_pixels > self.config.media.max_request_pixels:
                raise RequestError(status=400, message=f"the request's images have more than "
                                   f"{self.config.media.max_request_pixels} pixels in all (--max-request-pixels)",
                                   param="messages")
            key = mm_hash(data, self.info.fingerprint, self.processor_config)
            images[key] = data
            num_patches[key] = t * h * w
            refs.append(ImageRef(width, height, key))
        try:
            prompt = self.prompts.build(req.messages, refs, req.add_generation_prompt, req.tools,
                                        max_tokens=max_prompt_tokens)
        except PromptTooLong as exc:
            raise self._too_long(exc, "messages") from None
        except ValueError as exc:
            raise RequestError(status=400, message=str(exc), param="messages") from None
        return _Prepared(prompt.token_ids, prompt.mm_spans, images, num_patches)

    def _too_long(self, exc: PromptTooLong, param: str) -> RequestError:
        return RequestError(status=400, message=f"this model's maximum context length is {self.max_model_len} "
                            f"tokens; {exc}, leaving none to generate", param=param)

    def _check_length(self, req: GenerateRequest, num_prompt_tokens: int) -> int:
        """The max_tokens to use; RequestError when the prompt leaves no room."""
        room = self.max_model_len - num_prompt_tokens
        max_tokens = req.sampling.max_tokens
        if room < 1 or (max_tokens is not None and max_tokens > room):
            asked = num_prompt_tokens + (max_tokens or 1)
            raise RequestError(status=400, message=f"this model's maximum context length is {self.max_model_len} tokens; the "
                               f"request asks for {asked} ({num_prompt_tokens} in the prompt, "
                               f"{max_tokens or 1} to generate)", param="max_tokens")
        return max_tokens if max_tokens is not None else room

    def _cache_reaches(self, worker: WorkerInfo) -> bool:
        """Whether `worker` reads the cache this process looks up (same dir, same host)."""
        return self.cache is not None and worker.mm_cache_dir == self.mm_cache_dir \
            and worker.host in ("", self.host)

    # ------------------------------------------------------------ requests

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Delta]:
        """One sequence, start to finish. A worker that dies under it (or fails
        a step) costs nothing visible: the request is sent again, as prompt plus
        the tokens already streamed, to live workers (`Retry`)."""
        limits = self.config.limits
        deadline = time.monotonic() + limits.request_timeout_s
        self._admit_request()
        self.num_active += 1
        held_image_bytes = 0
        try:
            raw_images = await self._load_images(req)
            held_image_bytes = self._admit_image_bytes(sum(len(b) for b in raw_images))
            if req.messages is None and not isinstance(req.prompt, str):
                prep = self._prepare(req, raw_images)  # token ids: nothing to tokenize, no thread hop
            else:
                prep = await asyncio.to_thread(self._prepare, req, raw_images)
            max_tokens = self._check_length(req, len(prep.token_ids))
            detok = IncrementalDetokenizer(self.tokenizer, prep.token_ids, req.sampling.skip_special_tokens,
                                           req.sampling.stop)
            emitted: list[int] = []  # every token streamed so far, over all attempts
            num_cached, dispatched_s, why = 0, None, ""
            for attempt_no in range(MAX_ATTEMPTS):
                if attempt_no:
                    self.metrics.requests_recovered["resumed" if emitted else "retried"] += 1
                attempt = await self._start_attempt(req, prep, emitted, max_tokens, attempt_no, deadline)
                dispatched_s = dispatched_s or time.monotonic()  # the end of request_queue_time_seconds
                in_order = TokenOrder(attempt.queue)
                # the deadline arrives as an event in the queue: asyncio.wait_for (Python 3.11) can
                # swallow the cancellation that a client leaving delivers, and the request would run on
                timer = asyncio.get_running_loop().call_later(max(0.0, deadline - time.monotonic()),
                                                              attempt.queue.put_nowait, DEADLINE)
                try:
                    carried = None  # an event met while taking what had accumulated: handled next
                    while True:
                        out = carried if carried is not None else await in_order.next()
                        carried = None
                        if out is DEADLINE:
                            self.metrics.requests_failed["timeout"] += 1
                            raise RequestError(status=503, message=f"the request did not finish within "
                                               f"--request-timeout ({limits.request_timeout_s:g} s)",
                                               type="service_unavailable", retry_after_s=1)
                        if isinstance(out, Lost):
                            raise Retry(f"worker {out.worker_id} is gone")
                        if out.error is not None:
                            if out.is_internal_error:
                                raise Retry(out.error)
                            self.metrics.requests_failed["bad_input" if not emitted else "worker_error"] += 1
                            if not emitted:
                                raise RequestError(status=400, message=out.error,
                                                   param="messages" if prep.images else None)
                            yield Delta("", [], "abort", len(prep.token_ids), num_cached)
                            return
                        if held_image_bytes:  # prefilled: its images are no longer needed
                            self._release_image_bytes(held_image_bytes)
                            held_image_bytes = 0
                        if not emitted:
                            num_cached = out.num_cached_tokens
                        # Every output already here goes into one Delta (one SSE event): a reader
                        # that fell behind catches up in one step instead of one per token.
                        token_ids, logprobs, parts, finish = [], [] if out.logprobs else None, [], None
                        while True:
                            new_ids, new_logprobs, num_read = out.token_ids, out.logprobs, detok.num_tokens
                            parts.append(detok.push(new_ids))
                            if detok.is_stopped:  # tokens after the stop string (held by a stream interval) go
                                new_ids = new_ids[:detok.num_tokens - num_read]
                                new_logprobs = new_logprobs and new_logprobs[:len(new_ids)]
                            attempt.num_emitted += len(new_ids)
                            emitted += new_ids
                            token_ids += new_ids
                            if logprobs is not None:
                                logprobs += new_logprobs or ()
                            finish = "stop" if detok.is_stopped else out.finish_reason if out.finished else None
                            if finish is not None:
                                parts.append(detok.finish())
                                attempt.is_finished = out.finished
                                break
                            out = in_order.next_nowait()
                            if out is None:
                                break
                            if not isinstance(out, TokenOutput) or out.error is not None:
                                carried = out
                                break
                        yield Delta("".join(parts), token_ids, finish, len(prep.token_ids), num_cached,
                                    logprobs, dispatched_s=dispatched_s)
                        if finish is not None:
                            return
                except Retry as retry:
                    why = str(retry)
                    log.warning("request %s: %s; sending it again (%d tokens streamed)", req.request_id, why,
                                len(emitted))
                finally:
                    timer.cancel()
                    await self._end_attempt(attempt)
            self.metrics.requests_failed["worker_error"] += 1
            raise RequestError(status=503, message=f"the request failed on {MAX_ATTEMPTS} workers in turn ({why})",
                               type="service_unavailable", retry_after_s=1)
        finally:
            self.num_active -= 1
            self._release_image_bytes(held_image_bytes)

    def _admit_request(self) -> None:
        limits = self.config.limits
        if self.draining:
            self.metrics.requests_refused["draining"] += 1
            raise RequestError(status=503, message="the server is shutting down", type="service_unavailable",
                               retry_after_s=5)
        down = self.registry.down_roles(self.final_roles)
        if down:  # every request ends on one of these: none can be served until it is back
            self.metrics.requests_refused["role_down"] += 1
            raise RequestError(status=503, message=f"no live {' or '.join(down)} worker: the role is down "
                               f"(see /health)", type="service_unavailable", retry_after_s=ROLE_DOWN_RETRY_AFTER_S)
        if self.num_active >= limits.max_pending_requests:
            self.metrics.requests_refused["busy"] += 1
            raise RequestError(status=503, message=f"the server is busy: {self.num_active} requests in progress "
                               f"(--max-pending-requests)", type="service_unavailable", retry_after_s=1)

    def _admit_image_bytes(self, num_bytes: int) -> int:
        limit = self.config.limits.max_pending_image_bytes
        if num_bytes and self.pending_image_bytes + num_bytes > limit:
            self.metrics.requests_refused["image_bytes"] += 1
            raise RequestError(status=503, message=f"the server is busy: {self.pending_image_bytes} image bytes are "
                               f"waiting to be encoded (--max-pending-image-mb)", type="service_unavailable",
                               retry_after_s=1)
        self.pending_image_bytes += num_bytes
        return num_bytes

    def _release_image_bytes(self, num_bytes: int) -> None:
        self.pending_image_bytes -= num_bytes

    async def _choose(self, roles: tuple[str, ...], deadline: float) -> list[WorkerInfo]:
        """Live workers of `roles`, waiting (until the deadline) while a restart brings one back."""
        while True:
            workers = self.registry.live(*roles)
            if workers:
                return workers
            if time.monotonic() > deadline or len(self.registry.down_roles(roles)) == len(roles):
                self.metrics.requests_failed["no_worker"] += 1
                raise RequestError(status=503, message=f"no live {' or '.join(map(str, roles))} worker",
                                   type="service_unavailable", retry_after_s=5)
            await asyncio.sleep(NO_WORKER_POLL_S)

    async def _start_attempt(self, req: GenerateRequest, prep: _Prepared, emitted: list[int], max_tokens: int,
                             attempt_no: int, deadline: float) -> Attempt:
        """Routes and sends one try of a request: prompt + `emitted`, with the
        rest of its token budget, to live workers."""
        decode = None
        if self._prefills_locally(prep, emitted):
            decoders = await self._choose((Role.DECODE,), deadline)
            idle = idle_prefill_workers(decoders, self.registry.live(Role.PREFILL), self._pending_prefill_tokens(),
                                        len(prep.token_ids) + len(emitted), self.max_local_prefill_tokens)
            if idle:  # no decode worker can start it in its next step: an idle prefill worker starts it now
                prefill = self.text_prefill_router.choose(idle, prep.token_ids)
                decode = self.decode_router.choose(decoders, prep.token_ids)
                self.metrics.local_prefills_redirected += 1
            else:  # the decode worker prefills it itself: no KV moves
                prefill = self.local_prefill_router.choose(decoders, prep.token_ids)
                self.metrics.local_prefills += 1
        else:
            router = self.prefill_router if prep.images else self.text_prefill_router
            prefill = router.choose(await self._choose(PREFILL_ROLES, deadline), prep.token_ids)
            if prefill.role == Role.PREFILL:
                decode = self.decode_router.choose(await self._choose((Role.DECODE,), deadline), prep.token_ids)
        misses = []
        if attempt_no == 0 and prep.mm_spans:
            self.metrics.request_images.observe(len(prep.mm_spans))
        for key, data in prep.images.items():
            if attempt_no == 0:
                self.metrics.mm_cache_queries += 1
            if self._cache_reaches(prefill) and self.cache.contains(key):
                if attempt_no == 0:  # the prefill worker reads it: no encoder work
                    self.metrics.mm_cache_hits += 1
                    self.metrics.mm_cache_hit_tokens += prep.num_patches[key] // self.geometry.merge_size ** 2
            else:
                misses.append((key, data))
        if prefill.role == Role.AGGREGATED:
            encoders = [prefill] * len(misses)
        elif misses:
            encoders = self.encoder_router.assign(await self._choose((Role.ENCODER,), deadline),
                                                  [(key, prep.num_patches[key]) for key, _ in misses])
        else:
            encoders = []
        attempt_id = req.request_id if attempt_no == 0 else f"{req.request_id}~retry{attempt_no}"
        attempt = Attempt(attempt_id, asyncio.Queue(), prefill, decode, len(prep.token_ids) + len(emitted))
        self.attempts[attempt_id] = attempt
        sampling = replace(req.sampling, max_tokens=max_tokens - len(emitted), n=1,
                           min_tokens=max(0, req.sampling.min_tokens - len(emitted)),
                           stream_interval=self.config.stream_interval)
        try:
            # The PrefillRequest goes before its EncodeRequests, so an idle prefill worker
            # has it before any EncodeDone (a busy one may still read them out of order).
            await self._outbox.send(prefill.inbox, PrefillRequest(
                attempt_id, prep.token_ids + emitted, list(prep.mm_spans), sampling, list(self.info.eos_token_ids),
                decode.inbox if decode else None, self.api_index))
            for (key, data), enc in zip(misses, encoders):
                attempt.encoders.append(enc)
                await self._outbox.send(enc.inbox, EncodeRequest(
                    attempt_id, key, data, reply_to=prefill.inbox,
                    with_tensors=enc is not prefill and not enc.shares_cache_with(prefill)))
                if enc is not prefill:
                    self.encoder_router.on_sent(enc, key, prep.num_patches[key])
        except BaseException:  # the client left while we sent (cancelled): what was sent is aborted
            await self._end_attempt(attempt)
            raise
        return attempt

    def _prefills_locally(self, prep: _Prepared, emitted: list[int]) -> bool:
        """Conditional disaggregation (`--max-local-prefill-tokens`, e-p-d): a
        text-only prompt this short is prefilled on a decode worker, so it never
        queues behind image prompts' chunks at the prefill worker."""
        return not prep.mm_spans and 0 < len(prep.token_ids) + len(emitted) <= self.max_local_prefill_tokens

    def _pending_prefill_tokens(self) -> Counter[str]:
        """Worker id -> prompt tokens of this API process's requests it is prefilling (sent, first token not back)."""
        pending = Counter()
        for attempt in self.attempts.values():
            if attempt.num_emitted == 0:
                pending[attempt.prefill.worker_id] += attempt.num_prompt_tokens
        return pending

    async def _end_attempt(self, attempt: Attempt) -> None:
        """Forgets an attempt; unless it finished, frees every worker's share of it
        (client gone, stop string, error, or a retry elsewhere)."""
        self.attempts.pop(attempt.attempt_id, None)
        if attempt.is_finished:
            return
        self._abandoned[attempt.attempt_id] = None
        while len(self._abandoned) > MAX_ABANDONED:
            self._abandoned.popitem(last=False)
        for w in attempt.workers():
            try:
                await self._outbox.send(w.inbox, Abort([attempt.attempt_id]))
            except Exception:
                log.warning("could not send Abort to %s", w.worker_id)

    # ------------------------------------------------------- worker faults

    def on_worker_exit(self, worker_id: str, exit_code: int | None, restarting: bool = True) -> None:
        """The supervisor saw a worker process exit: route around it and
        recover the requests it held. `restarting`: it starts the worker again
        soon (else, given up for now, the role may be down: requests needing it
        are refused at once)."""
        info = self.registry.mark_dead(worker_id, restarting)
        log.warning("worker %s exited (code %s)%s", worker_id, exit_code, "" if restarting else ", not restarted")
        if info is not None:
            self._fail_over(worker_id)

    def forget_worker(self, worker_id: str) -> None:
        """A worker removed on purpose (autoscaling) after the registry retired it:
        the tries that still need it are sent again, and it leaves the registry."""
        if worker_id in self.registry.workers:
            self._fail_over(worker_id)
        self.registry.forget(worker_id)
        self._silent.discard(worker_id)

    def _fail_over(self, worker_id: str) -> None:
        for attempt in list(self.attempts.values()):
            if attempt.needs(worker_id):
                attempt.queue.put_nowait(Lost(worker_id))

    async def _watch_heartbeats(self) -> None:
        """Workers nobody supervises here (`epd worker` on other hosts, Ray
        actors) are dead once silent past the registry's heartbeat timeout, or
        stuck: busy (still saying Alive) past the request timeout."""
        while True:
            await asyncio.sleep(HEARTBEAT_CHECK_S)
            for w in list(self.registry.workers.values()):
                if w.is_dead or w.is_retired or self.registry.is_alive(w) or w.worker_id in self._silent:
                    continue
                self._silent.add(w.worker_id)
                if self.registry.is_stuck(w):
                    log.warning("worker %s busy for %.0f s (stuck): treated as dead until it reports again",
                                w.worker_id, w.busy_s)
                else:
                    log.warning("worker %s silent for %.0f s: treated as dead", w.worker_id,
                                self.registry.heartbeat_timeout_s)
                self._fail_over(w.worker_id)

