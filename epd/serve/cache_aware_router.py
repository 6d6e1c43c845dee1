"""CacheAwareRouter (`--router cache_aware`): the worker holding the longest cached
prefix of a request, weighed against load, from this API process's PrefixIndex
(epd/serve/prefix_index.py; docs/decisions/cache-aware-routing.md).

    imbalance guard   loads (running + waiting + queued, plus the requests sent since
                      the worker's last stats) too far apart, SGLang's rule: max - min
                      > 64 and max > 1.5 x min -> the least loaded worker
    session           a request naming its conversation (`x-session-id`, else `user`)
                      goes where that conversation went before, while that worker lives
    nothing cached    no worker holds a block of it -> the least loaded (a new session)
    else              the best score: 3 x the fraction of its blocks cached there,
                      - 2 x its load above the least loaded's (1: the most loaded, or
                      LOAD_SPAN requests more when they are closer), - 2 x its KV usage
                      (llm-d's weights for its prefix, queue and KV-usage scorers)

The chosen worker is credited with the request's blocks at once (`insert_speculative`),
so the next request of a burst finds them before the worker's events come back.
Ties go in turn.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

from epd.serve.prefix_index import PrefixIndex

IMBALANCE_ABS = 64  # SGLang's balance_abs_threshold: requests
IMBALANCE_REL = 1.5  # SGLang's balance_rel_threshold
PREFIX_WEIGHT, LOAD_WEIGHT, KV_USAGE_WEIGHT = 3.0, 2.0, 2.0
LOAD_SPAN = 8  # requests: loads closer than this weigh in proportion (one request more is not the most loaded)
MAX_SESSIONS = 65536  # conversations remembered, least recently routed forgotten first


@dataclass(frozen=True)
class RouteQuery:
    """What the cache-aware router reads of a request."""

    block_hashes: list[int] = field(default_factory=list)  # its full blocks, as its workers' events name them
    session_id: str | None = None  # its conversation: the x-session-id header, else its `user`


def is_imbalanced(loads: list[int]) -> bool:
    """SGLang's guard: the loads are too far apart to follow the cache."""
    return max(loads) - min(loads) > IMBALANCE_ABS and max(loads) > IMBALANCE_REL * min(loads)


class CacheAwareRouter:
    def __init__(self, index: PrefixIndex):
        self.index = index
        self._turn = itertools.count()
        self._sent: dict[str, tuple[object, int]] = {}  # worker id -> (stats it was counted against, sent since)
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session id -> worker id, newest last
        self.num_choices = {"imbalance": 0, "session": 0, "least_loaded": 0, "cache": 0}  # why each was chosen

    def choose(self, workers: list, prompt_token_ids: list[int], query: RouteQuery | None = None):
        query = query or RouteQuery()
        start = next(self._turn)
        order = [workers[(start + k) % len(workers)] for k in range(len(workers))]
        loads = {w.worker_id: w.load + self._sent_since_stats(w) for w in order}
        least = min(order, key=lambda w: loads[w.worker_id])
        session = self._sessions.get(query.session_id) if query.session_id is not None else None
        if is_imbalanced(list(loads.values())):
            best, why = least, "imbalance"
        elif (sticky := next((w for w in order if w.worker_id == session), None)) is not None:
            best, why = sticky, "session"
        else:
            matched = {w.worker_id: self.index.match(w.worker_id, query.block_hashes) for w in order}
            if not any(matched.values()):
                best, why = least, "least_loaded"
            else:
                best, why = max(order, key=lambda w: self._score(w, matched, loads, len(query.block_hashes))), "cache"
        self.num_choices[why] += 1
        self._sent[best.worker_id] = (best.stats, self._sent_since_stats(best) + 1)
        if query.session_id is not None:
            self._sessions[query.session_id] = best.worker_id
            self._sessions.move_to_end(query.session_id)
            if len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        self.index.insert_speculative(best.worker_id, query.block_hashes)
        return best

    @staticmethod
    def _score(worker, matched: dict[str, int], loads: dict[str, int], num_blocks: int) -> float:
        low, high = min(loads.values()), max(loads.values())
        load = (loads[worker.worker_id] - low) / max(high - low, LOAD_SPAN)
        stats = worker.stats
        kv_usage = 1.0 - stats.num_free_blocks / stats.num_total_blocks if stats and stats.num_total_blocks else 0.0
        return PREFIX_WEIGHT * matched[worker.worker_id] / num_blocks - LOAD_WEIGHT * load - KV_USAGE_WEIGHT * kv_usage

    def _sent_since_stats(self, worker) -> int:
        stats, num_sent = self._sent.get(worker.worker_id, (None, 0))
        return num_sent if stats is worker.stats else 0  # a new report counts what it has received
