"""Choosing a worker for a request (`--router`).

round_robin   workers in turn.
least_loaded  power of two choices: of two workers drawn at random, the one
              with fewer running + waiting requests in its latest stats.
prefix_hash   consistent hashing of the prompt's first block-aligned tokens,
              so requests sharing a prefix land where its KV is cached.
cache_aware   the worker holding the most of the prompt (known from its prefix
              cache's changes) when that is over half of it, else the least
              loaded, with session affinity (epd/serve/cache_aware_router.py).

Under `least_loaded` (the default), text-only requests go to the worker with
the fewest requests (`LeastRequestsRouter`): they wait for no encoder, so the
least busy prefill worker is the one that starts them first.

With LoRA, every router chooses among `prefer_adapter`'s workers: those that
have the request's adapter resident in a slot, when their load is equal-ish
to the least loaded worker's (at most max(2, a quarter of it) requests more);
else among all.
"""
from __future__ import annotations

import bisect
import hashlib
import itertools
import random
import struct
from collections.abc import Mapping

from epd.serve.cache_aware_router import CacheAwareRouter
from epd.serve.prefix_index import PrefixIndex
from epd.serve.sent_since_stats import SentSinceStats

PREFIX_TOKENS = 64  # tokens of the prompt that pick the worker (4 KV blocks)
VIRTUAL_NODES = 64  # ring points per worker, for an even spread


def idle_prefill_workers(decoders: list, prefills: list, pending_tokens: Mapping[str, int], num_tokens: int,
                         step_tokens: int) -> list:
    """Where a short text-only prompt of `num_tokens` goes instead of a decode
    worker: the prefill workers with no prompt pending, when no decode worker
    can take it in its next step. `pending_tokens`: worker id -> prompt tokens
    sent to it whose first token is not back; a decode worker prefills at most
    `step_tokens` (--max-local-prefill-tokens) a step, so a prompt that does
    not fit beside those pending waits a whole prefill. Empty: prefill it on a
    decode worker."""
    if any(pending_tokens.get(d.worker_id, 0) + num_tokens <= step_tokens for d in decoders):
        return []
    return [w for w in prefills if not pending_tokens.get(w.worker_id)]


LORA_LOAD_SLACK = 2  # requests more than the least loaded worker a warm one may carry and still be preferred


def prefer_adapter(workers: list, lora_name: str | None) -> list:
    """The workers a request with adapter `lora_name` chooses among: those whose latest
    stats show it resident (no slot write, no read from host memory or disk), when each
    carries at most max(LORA_LOAD_SLACK, a quarter of it) requests more than the least
    loaded of `workers`; all of `workers` when none does (or for the base model):
    waiting behind others costs more than writing a slot."""
    if lora_name is None or len(workers) < 2:
        return workers
    least = min(w.load for w in workers)
    warm = [w for w in workers if w.has_adapter(lora_name) and w.load <= least + max(LORA_LOAD_SLACK, least // 4)]
    return warm or workers


class RoundRobinRouter:
    def __init__(self):
        self._counter = itertools.count()

    def choose(self, workers: list, prompt_token_ids: list[int]):
        return workers[next(self._counter) % len(workers)]


class LeastLoadedRouter:
    def __init__(self, seed: int = 0):
        self._rng = random.Random(seed)

    def choose(self, workers: list, prompt_token_ids: list[int]):
        if len(workers) == 1:
            return workers[0]
        a, b = self._rng.sample(workers, 2)
        return a if a.load <= b.load else b


class LeastRequestsRouter:
    """The worker with the fewest requests: its latest stats plus the requests sent
    to it since (a burst between two reports is spread); ties in turn."""

    def __init__(self):
        self._turn = itertools.count()
        self._sent = SentSinceStats()

    def choose(self, workers: list, prompt_token_ids: list[int]):
        start = next(self._turn)
        order = [workers[(start + k) % len(workers)] for k in range(len(workers))]
        best = min(order, key=lambda w: w.load + self._sent.count(w))
        self._sent.add(best)
        return best


class PrefixHashRouter:
    def __init__(self):
        self._ring: list[tuple[int, str]] = []
        self._members: tuple[str, ...] = ()

    @staticmethod
    def _hash(data: bytes) -> int:
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")

    def _rebuild(self, workers: list) -> None:
        self._members = tuple(sorted(w.worker_id for w in workers))
        self._ring = sorted((self._hash(f"{wid}#{v}".encode()), wid)
                            for wid in self._members for v in range(VIRTUAL_NODES))

    def choose(self, workers: list, prompt_token_ids: list[int]):
        if tuple(sorted(w.worker_id for w in workers)) != self._members:
            self._rebuild(workers)
        prefix = prompt_token_ids[:PREFIX_TOKENS]
        key = self._hash(struct.pack(f"<{len(prefix)}q", *prefix))
        i = bisect.bisect(self._ring, (key, "")) % len(self._ring)
        wid = self._ring[i][1]
        return next(w for w in workers if w.worker_id == wid)


ROUTERS = {"round_robin": RoundRobinRouter, "least_loaded": LeastLoadedRouter, "prefix_hash": PrefixHashRouter,
           "cache_aware": CacheAwareRouter}


def make_router(name: str, index: PrefixIndex | None = None):
    """`index`: what the cache-aware router reads (shared by an API process's routers; None: its own)."""
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}")
    if name == "cache_aware":
        return CacheAwareRouter(index if index is not None else PrefixIndex())
    return ROUTERS[name]()
