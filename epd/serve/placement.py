"""Where one attempt of a request runs, and the messages that start it there: `Placement`.

    routers           prefill (or pd / aggregated) worker, decode worker           epd/serve/router.py
                      (cache_aware: the request's block hashes looked up in the prefix index,
                      epd/serve/cache_aware_router.py, epd/serve/prefix_index.py)
    local prefill     e-p-d: a short text-only prompt to a decode worker alone, which prefills it
                      (or, when no decode worker has room, to an idle prefill worker); with
                      cache_aware, short is what a decode worker does not hold of it (a chat's next turn)
    cache lookup      an image the prefill worker can read from the cache needs no encoder
    encoders          every missing image, video, video chunk or audio clip to the encoder where it finishes first
                      (a video's cost: frames x patches, its patches over every temporal group;
                      a long video's chunks spread over the encoders)   epd/serve/encoder_router.py
    send              PrefillRequest at once (the worker waits for its images), then one
                      EncodeRequest per missing image, video, chunk or clip (a video's with its VideoPlan,
                      a clip's with its token count)

A request's placement is decided per attempt: a retry is placed again, on
live workers. With a LoRA adapter, each router chooses among the workers that
have it resident when their load is equal-ish (router.prefer_adapter); the
encoder router likewise for a tower adapter (encoder_router.py).
"""
from __future__ import annotations

import asyncio
import socket
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from epd.config import ServeConfig
from epd.engine.block_hash import prompt_block_hashes, root_block_hash
from epd.engine.model_info import ModelInfo
from epd.inputs.media_item import MediaItem
from epd.requests import GenerateRequest, RequestError
from epd.serve.attempt import Attempt
from epd.serve.cache_aware_router import CacheAwareRouter, RouteQuery
from epd.serve.encoder_router import EncoderRouter
from epd.serve.prefix_index import PrefixIndex
from epd.serve.preparer import Prepared
from epd.serve.registry import WorkerInfo, WorkerRegistry
from epd.serve.router import LeastRequestsRouter, idle_prefill_workers, make_router, prefer_adapter
from epd.serve.worker_metrics import WorkerMetrics
from epd.transport.wire.channels import AsyncOutbox
from epd.transport.wire.kv_events import external_block_hash
from epd.transport.wire.messages import EncodeRequest, PrefillRequest
from epd.transport.embedding_cache.mm_cache import MMCache
from epd.transport.wire.roles import Role

PREFILL_ROLES = tuple(role for role in Role if role.takes_prefill)
NO_WORKER_POLL_S = 0.05  # while no live worker of a role exists, look again this often


@dataclass
class Placed:
    """The workers one attempt runs on, and the images it must have encoded."""

    prefill: WorkerInfo  # prefill, pd or aggregated (or a decode worker that prefills locally)
    decode: WorkerInfo | None
    misses: list[MediaItem]  # the images, videos and chunks no cache it reads holds
    encoders: list[WorkerInfo]  # the encoder of each miss


class Placement:
    """Routers, the embedding cache lookup and the sends that start an attempt."""

    def __init__(self, config: ServeConfig, info: ModelInfo, registry: WorkerRegistry, metrics: WorkerMetrics,
                 attempts: dict[str, Attempt], mm_cache_dir: str, api_index: int = 0):
        """`attempts`: the orchestrator's tries in flight (read for the prompts each
        worker is prefilling)."""
        self.config = config
        self.info = info
        self.registry = registry
        self.metrics = metrics
        self.attempts = attempts
        self.mm_cache_dir = mm_cache_dir
        self.api_index = api_index
        self.host = socket.gethostname()
        # cache_aware: what each engine worker holds, from its KVBlocks (the collector applies them)
        self.prefix_index = PrefixIndex() if config.router == "cache_aware" else None
        self.block_size = config.engine.scheduler.block_size
        self.prefill_router = make_router(config.router, self.prefix_index)
        self.decode_router = make_router(config.router if config.router != "prefix_hash" else "least_loaded",
                                         self.prefix_index)
        # text-only requests wait for no encoder: the least busy prefill worker starts them first
        self.text_prefill_router = LeastRequestsRouter() if config.router == "least_loaded" else self.prefill_router
        # conditional disaggregation: short text-only prompts go to the least busy decode worker
        self.local_prefill_router = LeastRequestsRouter() if config.router == "least_loaded" else self.decode_router
        self.max_local_prefill_tokens = config.engine.scheduler.max_local_prefill_tokens \
            if Role.DECODE in {role for role, _ in config.mode_roles()} else 0
        self.encoder_router = EncoderRouter(config.encoder_router)
        self.cache: MMCache | None = None

    # -------------------------------------------------------------- cache

    def open_cache(self) -> None:
        """Opens the workers' embedding cache read-only, once it exists (a worker made it)."""
        if self.cache is None and (Path(self.mm_cache_dir) / "data.mdb").exists():
            cache = MMCache(self.mm_cache_dir, self.config.mm_cache_bytes, readonly=True,
                            model_fingerprint=self.info.fingerprint)
            # unreadable (corrupt, a worker sets it aside): serve on, every image to an encoder
            self.cache = cache if cache.is_open else None

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()

    def _cache_reaches(self, worker: WorkerInfo) -> bool:
        """Whether `worker` reads the cache this process looks up (same dir, same host)."""
        return self.cache is not None and worker.mm_cache_dir == self.mm_cache_dir \
            and worker.host in ("", self.host)

    # -------------------------------------------------------------- place

    async def place(self, prep: Prepared, emitted: list[int], attempt_no: int, deadline: float,
                    lora_name: str | None = None, session_id: str | None = None) -> Placed:
        """Live workers for one try of a request (prompt + `emitted`, adapter `lora_name`, conversation
        `session_id`): prefill and decode worker, the images no cache they read holds, and each one's encoder."""
        prefill, decode = await self._route(prep, emitted, deadline, lora_name, session_id)
        misses = self._cache_misses(prep, prefill, count=attempt_no == 0)
        if prefill.role == Role.AGGREGATED:
            encoders = [prefill] * len(misses)
        elif misses:
            tower_lora = None if prep.tower_lora is None else prep.tower_lora.lora_name
            encoders = self.encoder_router.assign(await self._live((Role.ENCODER,), deadline),
                                                  [(item.key, item.num_patches) for item in misses], tower_lora)
        else:
            encoders = []
        return Placed(prefill, decode, misses, encoders)

    async def _route(self, prep: Prepared, emitted: list[int], deadline: float,
                     lora_name: str | None, session_id: str | None) -> tuple[WorkerInfo, WorkerInfo | None]:
        """(prefill worker, decode worker or None) of one try."""
        decode = None
        query = self._route_query(prep, emitted, lora_name, session_id)

        def choose(router, workers: list[WorkerInfo]) -> WorkerInfo:
            if isinstance(router, CacheAwareRouter):
                return router.choose(prefer_adapter(workers, lora_name), prep.token_ids, query)
            return router.choose(prefer_adapter(workers, lora_name), prep.token_ids)

        num_local = self._local_prefill_tokens(prep, emitted, query)
        if num_local is not None:
            decoders = await self._live((Role.DECODE,), deadline)
            idle = idle_prefill_workers(decoders, self.registry.live(Role.PREFILL), self._pending_prefill_tokens(),
                                        num_local, self.max_local_prefill_tokens)
            if idle:  # no decode worker can start it in its next step: an idle prefill worker starts it now
                prefill = choose(self.text_prefill_router, idle)
                decode = choose(self.decode_router, decoders)
                self.metrics.local_prefills_redirected += 1
            else:  # the decode worker prefills it itself: no KV moves
                prefill = choose(self.local_prefill_router, decoders)
                self.metrics.local_prefills += 1
        else:
            router = self.prefill_router if prep.items else self.text_prefill_router
            prefill = choose(router, await self._live(PREFILL_ROLES, deadline))
            if prefill.role == Role.PREFILL:
                decode = choose(self.decode_router, await self._live((Role.DECODE,), deadline))
        return prefill, decode

    def _cache_misses(self, prep: Prepared, prefill: WorkerInfo, count: bool) -> list[MediaItem]:
        """The items `prefill` cannot read from the cache; `count`: the first try's
        lookups go into the cache metrics."""
        misses = []
        if count and prep.mm_spans:
            # an item written as several runs (first_row > 0 after its first) counts once
            self.metrics.request_images.observe(sum(1 for span in prep.mm_spans if span.first_row == 0))
        for item in prep.items:
            if count:
                self.metrics.mm_cache_queries += 1
            # a video is there when every entry its spans name is (one per temporal group, or one)
            if self._cache_reaches(prefill) and all(self.cache.contains(k) for k in item.entries):
                if count:  # the prefill worker reads it: no encoder work
                    self.metrics.mm_cache_hits += 1
                    self.metrics.mm_cache_hit_tokens += item.num_tokens
            else:
                misses.append(item)
        return misses

    async def _live(self, roles: tuple[str, ...], deadline: float) -> list[WorkerInfo]:
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

    def _local_prefill_tokens(self, prep: Prepared, emitted: list[int], query: RouteQuery | None) -> int | None:
        """Conditional disaggregation (`--max-local-prefill-tokens`, e-p-d): a text-only
        prompt this short is prefilled on a decode worker, so it never queues behind
        image prompts' chunks at the prefill worker. Short: its tokens, or with
        cache_aware those past the longest prefix a decode worker holds (a chat's next
        turn, prefilled where its conversation's KV is). None: not short."""
        if prep.mm_spans or not self.max_local_prefill_tokens:
            return None
        num_tokens = len(prep.token_ids) + len(emitted)
        if query is not None and query.block_hashes:
            num_tokens -= self.block_size * max((self.prefix_index.match(w.worker_id, query.block_hashes)
                                                 for w in self.registry.live(Role.DECODE)), default=0)
        return num_tokens if 0 < num_tokens <= self.max_local_prefill_tokens else None

    def _route_query(self, prep: Prepared, emitted: list[int], lora_name: str | None,
                     session_id: str | None) -> RouteQuery | None:
        """What the cache-aware router reads of one try (None under another router): the hashes of
        the blocks a worker could hit (every full block but one token: engine/block_hash.py, as
        the block manager computes them) and the conversation. An adapter's blocks are keyed by
        the files the worker read, which this process does not see: its own root makes them
        match only what this process sent (`insert_speculative`), never another request's."""
        if self.prefix_index is None:
            return None
        token_ids = prep.token_ids + emitted
        root = root_block_hash(None if lora_name is None else (lora_name, "", None))
        block_hashes = prompt_block_hashes(token_ids, prep.mm_spans, self.block_size,
                                           (len(token_ids) - 1) // self.block_size, root)
        return RouteQuery([external_block_hash(h) for h in block_hashes], session_id)

    def _pending_prefill_tokens(self) -> Counter[str]:
        """Worker id -> prompt tokens of this API process's requests it is prefilling (sent, first token not back)."""
        pending = Counter()
        for attempt in self.attempts.values():
            if attempt.num_emitted == 0:
                pending[attempt.prefill.worker_id] += attempt.num_prompt_tokens
        return pending

    # --------------------------------------------------------------- send

    async def send(self, outbox: AsyncOutbox, attempt: Attempt, placed: Placed, req: GenerateRequest,
                   prep: Prepared, emitted: list[int]) -> None:
        """The PrefillRequest of one try (prompt + `emitted`, with the rest of the
        request's token budget), then one EncodeRequest per missing image."""
        prefill, decode = placed.prefill, placed.decode
        sampling = replace(req.sampling, max_tokens=prep.max_tokens - len(emitted), n=1,
                           min_tokens=max(0, req.sampling.min_tokens - len(emitted)),
                           stream_interval=max(self.config.stream_interval, req.sampling.stream_interval))
        # The PrefillRequest goes before its EncodeRequests, so an idle prefill worker
        # has it before any EncodeDone (a busy one may still read them out of order).
        await outbox.send(prefill.inbox, PrefillRequest(
            attempt.attempt_id, prep.token_ids + emitted, list(prep.mm_spans), sampling,
            list(self.info.eos_token_ids), decode.inbox if decode else None, self.api_index, lora=req.lora))
        for item, enc in zip(placed.misses, placed.encoders):
            attempt.encoders.append(enc)
            await outbox.send(enc.inbox, EncodeRequest(  # a video chunk carries its video's mm_hash
                attempt.attempt_id, item.mm_hash, item.data, reply_to=prefill.inbox,
                with_tensors=enc is not prefill and not enc.shares_cache_with(prefill),
                video=item.video, lora=prep.tower_lora, alone=attempt.alone,
                audio_tokens=item.num_tokens if item.is_audio else 0))
            if enc is not prefill:
                self.encoder_router.on_sent(enc, item.key, item.num_patches)
