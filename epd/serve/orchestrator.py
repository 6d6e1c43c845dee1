"""The API process's side of a request: prompt, routing, fan-out, streaming back.

    generate(request):
      media -> raw bytes (never pixels): data:, file:// in a thread,   epd/inputs/media.py
               http(s):// fetched with httpx on the event loop
      header size -> mm_hash, in a thread                            encoders/image_io.py
      chat template + placeholder expansion                          epd/inputs/prompt.py
      route: prefill (or pd / aggregated) worker, decode worker      epd/serve/router.py
      embedding cache lookup
      PrefillRequest at once (the worker waits for its images), then
      misses -> EncodeRequest, one image per encoder in turn
      TokenOutputs from the collector -> detokenize, stop strings -> Delta
      closed early (client gone) or stopped by a stop string -> Abort to every worker involved

The collector socket receives everything workers send the API: Ready,
WorkerStats, TokenOutput.
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import AsyncIterator

from epd.encoders.image_io import ImageError, read_image_size
from epd.encoders.image_processor import ImageGeometry
from epd.detokenizer import IncrementalDetokenizer
from epd.engine.model_info import ModelInfo
from epd.config import ServeConfig
from epd.inputs.media import MediaError, MediaFetcher, image_part_source
from epd.inputs.prompt import ImageRef, PromptBuilder, image_parts
from epd.api.protocol import Delta, GenerateRequest, RequestError
from epd.serve.router import RoundRobinRouter, make_router
from epd.serve.worker_metrics import WorkerMetrics
from epd.serve.registry import WorkerInfo, WorkerRegistry
from epd.serve.token_order import TokenOrder
from epd.transport.channels import AsyncOutbox, AsyncReceiver
from epd.transport.messages import (Abort, EncodeRequest, PrefillRequest, Ready, Shutdown, TokenOutput,
                                WireError, WorkerStats)
from epd.transport.mm_cache import MMCache, mm_hash
from epd.transport.mm_span import MMSpan
from epd.transport.roles import Role

log = logging.getLogger("epd.api")


@dataclass
class _Prepared:
    token_ids: list[int]
    mm_spans: list[MMSpan]
    images: dict[str, bytes]  # mm_hash -> raw bytes, distinct images


class Orchestrator:
    def __init__(self, config: ServeConfig, collector_address: str, mm_cache_dir: str):
        """`mm_cache_dir`: the embedding cache the launcher's workers share
        (`--mm-cache-dir`, or one it made under its run dir)."""
        from transformers import AutoConfig, AutoTokenizer

        self.config = config
        self.mm_cache_dir = mm_cache_dir
        hf_config = AutoConfig.from_pretrained(config.model)
        self.info = ModelInfo.from_pretrained(config.model, hf_config)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        self.geometry = ImageGeometry.from_pretrained(config.model)
        self.prompts = PromptBuilder(self.tokenizer, self.geometry, self.info.image_token_id)
        self.processor_config = json.loads((Path(config.model) / "preprocessor_config.json").read_text())
        self.media = MediaFetcher(config.media)
        self.model_name = config.model_name
        self.max_model_len = config.engine.resolved_max_model_len(self.info.max_model_len)
        self.vocab_size = self.info.vocab_size
        self.collector_address = collector_address
        self.host = socket.gethostname()
        self.registry = WorkerRegistry()
        self.metrics = WorkerMetrics(self.registry)
        self.prefill_router = make_router(config.router)
        self.decode_router = make_router(config.router if config.router != "prefix_hash" else "least_loaded")
        self.encoder_turn = RoundRobinRouter()
        self.cache: MMCache | None = None
        self.streams: dict[str, asyncio.Queue] = {}
        self._receiver: AsyncReceiver | None = None
        self._outbox: AsyncOutbox | None = None
        self._dispatcher: asyncio.Task | None = None

    # ---------------------------------------------------------- lifecycle

    async def start(self) -> None:
        self._receiver = AsyncReceiver(self.collector_address)
        self._outbox = AsyncOutbox()
        self._dispatcher = asyncio.create_task(self._dispatch())

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

    async def stop(self) -> None:
        if self._outbox is not None:
            for w in list(self.registry.workers.values()):
                try:
                    await asyncio.wait_for(self._outbox.send(w.inbox, Shutdown()), 1.0)
                except (asyncio.TimeoutError, Exception):
                    log.warning("could not send Shutdown to %s", w.worker_id)
        if self._dispatcher is not None:
            self._dispatcher.cancel()
        if self.cache is not None:
            self.cache.close()
        await self.media.aclose()
        await asyncio.sleep(0.05)  # let the Shutdowns leave
        if self._outbox is not None:
            self._outbox.close()
        if self._receiver is not None:
            self._receiver.close()

    async def _dispatch(self) -> None:
        while True:
            try:
                msg = await self._receiver.recv()
            except WireError as exc:
                log.warning("collector: dropped a malformed message: %s", exc)
                continue
            if isinstance(msg, TokenOutput):
                queue = self.streams.get(msg.request_id)
                if queue is not None:
                    queue.put_nowait(msg)
            elif isinstance(msg, WorkerStats):
                self.registry.on_stats(msg)
            elif isinstance(msg, Ready):
                info = self.registry.on_ready(msg)
                log.info("worker %s (%s) ready at %s", info.worker_id, info.role, info.inbox)
                self._open_cache()

    # ------------------------------------------------------------- facade

    def is_healthy(self) -> bool:
        return self.registry.all_alive()

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
        loads = [asyncio.ensure_future(self.media.load(image_part_source(part)))
                 for part in image_parts(req.messages)]
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
        if req.messages is None:
            prompt = req.prompt
            ids = self.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else list(prompt)
            if not ids:
                raise RequestError(status=400, message="the prompt is empty", param="prompt")
            if any(not 0 <= t < self.info.vocab_size for t in ids):
                raise RequestError(status=400, message=f"token ids must be in [0, {self.info.vocab_size})", param="prompt")
            return _Prepared(ids, [], {})
        images, refs = {}, []
        for data in raw_images:
            try:
                width, height = read_image_size(data, self.config.media.max_image_pixels)
                self.geometry.grid_thw(width, height)  # refuses aspect ratios the processor refuses
            except (ImageError, ValueError) as exc:
                raise RequestError(status=400, message=str(exc), param="messages") from None
            key = mm_hash(data, self.info.fingerprint, self.processor_config)
            images[key] = data
            refs.append(ImageRef(width, height, key))
        try:
            prompt = self.prompts.build(req.messages, refs, req.add_generation_prompt, req.tools)
        except ValueError as exc:
            raise RequestError(status=400, message=str(exc), param="messages") from None
        return _Prepared(prompt.token_ids, prompt.mm_spans, images)

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

    def _workers(self, *roles: str) -> list[WorkerInfo]:
        workers = [w for w in self.registry.by_role(*roles) if self.registry.is_alive(w)]
        return workers or self.registry.by_role(*roles)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Delta]:
        raw_images = await self._load_images(req)
        prep = await asyncio.to_thread(self._prepare, req, raw_images)
        max_tokens = self._check_length(req, len(prep.token_ids))
        sampling = replace(req.sampling, max_tokens=max_tokens, n=1)
        prefill_workers = self._workers(*(role for role in Role if role.takes_prefill))
        if not prefill_workers:
            raise RequestError(status=503, message="no prefill worker is registered yet", type="service_unavailable")
        prefill = self.prefill_router.choose(prefill_workers, prep.token_ids)
        decode = None
        if prefill.role == Role.PREFILL:
            decode_workers = self._workers(Role.DECODE)
            if not decode_workers:
                raise RequestError(status=503, message="no decode worker is registered yet", type="service_unavailable")
            decode = self.decode_router.choose(decode_workers, prep.token_ids)
        encoders = [prefill] if prefill.role == Role.AGGREGATED else self._workers(Role.ENCODER)
        misses = []
        for key, data in prep.images.items():
            self.metrics.mm_cache_queries += 1
            if self._cache_reaches(prefill) and self.cache.contains(key):
                self.metrics.mm_cache_hits += 1  # the prefill worker reads it: no encoder work
            elif not encoders:
                raise RequestError(status=503, message="no encoder worker is registered yet", type="service_unavailable")
            else:
                misses.append((key, data))
        rid = req.request_id
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[rid] = queue
        involved = [prefill] + ([decode] if decode else [])
        done = False
        try:
            # The PrefillRequest goes before its EncodeRequests, so an idle prefill worker
            # has it before any EncodeDone (a busy one may still read them out of order).
            await self._outbox.send(prefill.inbox, PrefillRequest(
                rid, prep.token_ids, list(prep.mm_spans), sampling, list(self.info.eos_token_ids),
                decode.inbox if decode else None))
            dispatched_s = time.monotonic()  # the end of request_queue_time_seconds
            for key, data in misses:
                enc = self.encoder_turn.choose(encoders, prep.token_ids)
                if enc not in involved:
                    involved.append(enc)
                await self._outbox.send(enc.inbox, EncodeRequest(
                    rid, key, data, reply_to=prefill.inbox,
                    with_tensors=enc is not prefill and not enc.shares_cache_with(prefill)))
            detok = IncrementalDetokenizer(self.tokenizer, prep.token_ids, req.sampling.skip_special_tokens,
                                           req.sampling.stop)
            num_cached = 0
            num_emitted = 0
            in_order = TokenOrder(queue)
            while True:
                out = await in_order.next()
                if out.error is not None:
                    if num_emitted == 0:
                        raise RequestError(status=400, message=out.error, param="messages" if prep.images else None)
                    yield Delta("", [], "abort", len(prep.token_ids), num_cached)
                    done = True
                    return
                if num_emitted == 0:
                    num_cached = out.num_cached_tokens
                num_emitted += len(out.token_ids)
                text = detok.push(out.token_ids)
                finish = out.finish_reason if out.finished else None
                if finish is None and detok.is_stopped:
                    finish = "stop"
                if finish is not None:
                    text += detok.finish()
                yield Delta(text, list(out.token_ids), finish, len(prep.token_ids), num_cached,
                            out.logprobs, dispatched_s=dispatched_s)
                if finish is not None:
                    done = out.finished
                    return
        finally:
            self.streams.pop(rid, None)
            if not done:  # client gone, stop string, or error: free every worker's share of it
                for w in involved:
                    try:
                        await self._outbox.send(w.inbox, Abort([rid]))
                    except Exception:
                        log.warning("could not send Abort to %s", w.worker_id)

