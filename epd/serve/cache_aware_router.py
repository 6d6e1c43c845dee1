"""CacheAwareRouter (`--router cache_aware`): the worker holding the longest cached
prefix of a request, unless too little of it is cached or the loads are too far
apart, from this API process's PrefixIndex (epd/serve/prefix_index.py;
docs/decisions/cache-aware-routing.md). SGLang's cache-aware rule, with sessions:

    imbalance guard   loads (running + waiting + queued, plus the requests sent since
                      the worker's last stats) too far apart, SGLang's rule: max - min
                      > 64 and max > 1.5 x min -> the least loaded worker
    session           a request naming its conversation (`x-session-id`, else `user`)
                      goes where that conversation went before, while that worker lives
    cache             more than CACHE_THRESHOLD of its blocks cached on some worker, or
                      a cached prefix that is a whole earlier prompt this router sent
                      (a conversation's next turn without a session) -> the worker
                      holding the most of them (ties: the less loaded)
    least loaded      else (a new conversation, whose only cached blocks may be a
                      system prompt every conversation shares) -> the least loaded,
                      ties to the one holding the fewest blocks (SGLang: the smallest
                      tree), so a shared prefix does not pull new work onto its holder

The chosen worker is credited with the request's blocks at once (`insert_speculative`),
so the next request of a burst finds them before the worker's events come back.
Remaining ties go in turn.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

from epd.serve.prefix_index import PrefixIndex
from epd.serve.sent_since_stats import SentSinceStats

IMBALANCE_ABS = 64  # SGLang's balance_abs_threshold: requests
IMBALANCE_REL = 1.5  # SGLang's balance_rel_threshold
CACHE_THRESHOLD = 0.5  # SGLang's cache_threshold: follow the cache when more than this fraction of the blocks is there
MAX_SESSIONS = 65536  # conversations (and prompts' last blocks) remembered, least recently routed forgotten first


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
        self._sent = SentSinceStats()
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session id -> worker id, newest last
        self._prompt_ends: OrderedDict[int, None] = OrderedDict()  # the last block of each prompt routed, newest last
        self.num_choices = {"imbalance": 0, "session": 0, "least_loaded": 0, "cache": 0}  # why each was chosen

    def choose(self, workers: list, prompt_token_ids: list[int], query: RouteQuery | None = None):
        query = query or RouteQuery()
        start = next(self._turn)
        order = [workers[(start + k) % len(workers)] for k in range(len(workers))]
        loads = {w.worker_id: w.load + self._sent.count(w) for w in order}
        least = min(order, key=lambda w: loads[w.worker_id])
        session = self._sessions.get(query.session_id) if query.session_id is not None else None
        if is_imbalanced(list(loads.values())):
            best, why = least, "imbalance"
        elif (sticky := next((w for w in order if w.worker_id == session), None)) is not None:
            best, why = sticky, "session"
        else:
            matched = {w.worker_id: self.index.match(w.worker_id, query.block_hashes) for w in order}
            holder = max(order, key=lambda w: (matched[w.worker_id], -loads[w.worker_id]))
            cached = query.block_hashes[:matched[holder.worker_id]]
            if len(cached) > CACHE_THRESHOLD * len(query.block_hashes) or any(h in self._prompt_ends for h in cached):
                best, why = holder, "cache"
            else:
                best = min(order, key=lambda w: (loads[w.worker_id], self.index.num_blocks(w.worker_id)))
                why = "least_loaded"
        self.num_choices[why] += 1
        self._sent.add(best)
        if query.session_id is not None:
            _remember(self._sessions, query.session_id, best.worker_id)
        if query.block_hashes:
            _remember(self._prompt_ends, query.block_hashes[-1], None)
        self.index.insert_speculative(best.worker_id, query.block_hashes)
        return best

def _remember(recent: OrderedDict, key, value) -> None:
    """`key` -> `value`, newest; the oldest forgotten past MAX_SESSIONS."""
    recent[key] = value
    recent.move_to_end(key)
    if len(recent) > MAX_SESSIONS:
        recent.popitem(last=False)
