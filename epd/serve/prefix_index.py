"""PrefixIndex: which KV blocks each engine worker holds, as this API process knows
it, for the cache-aware router (epd/serve/cache_aware_router.py).

Each engine worker started for `--router cache_aware` sends every API process a
`KVBlocks` after each step that changed its prefix cache: the hashes its block
manager registered ("stored"), evicted ("removed") or forgot ("cleared"), in
order, as vLLM's KV events carry them (8-byte ints, transport/wire/kv_events.py).
Applied in order they give exactly the set a prefix lookup on that worker can hit.
The API computes a request's hashes with the same function
(engine/block_hash.py) and asks, per worker, how many leading blocks it holds.

    apply(KVBlocks)     a worker's batch; a new session (a restart, or a worker
                        this process meets late) or a gap in `seq` clears its set
                        first: what it missed is unknown, and an empty set only
                        costs a hit, never a wrong one
    insert_speculative  the blocks of a request just sent to a worker, held until
                        its events confirm them or `speculative_ttl_s` passes, so
                        a burst of one prefix sticks before any event is back
    match               the number of a request's leading blocks a worker holds
    forget              a worker gone: nothing of it is kept

Each API process keeps its own index (every worker reports to every API process).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI reads the router names without loading the wire's tensor types (torch)
    from epd.transport.wire.messages import KVBlocks

SPECULATIVE_TTL_S = 5.0  # a routed request's blocks count as held this long before an event confirms them


class PrefixIndex:
    def __init__(self, speculative_ttl_s: float = SPECULATIVE_TTL_S, clock: Callable[[], float] = time.monotonic):
        self.speculative_ttl_s = speculative_ttl_s
        self._clock = clock
        self._blocks: dict[str, set[int]] = {}  # worker id -> hashes its events stored and did not remove
        # worker id -> hash -> expiry (clock), oldest first: one TTL, so insertion order is expiry order
        self._speculative: dict[str, OrderedDict[int, float]] = {}
        self._next_seq: dict[str, tuple[str, int]] = {}  # worker id -> (its session, the seq expected next)
        self.num_gaps = 0  # batches that came after a gap (the worker's set was cleared)

    def apply(self, msg: KVBlocks) -> None:
        """One batch of `msg.worker_id`'s prefix-cache changes (its session checked by the caller)."""
        session, expected = self._next_seq.get(msg.worker_id, (None, 0))
        if session != msg.session or msg.seq != expected:
            if session == msg.session:
                self.num_gaps += 1
            self.forget(msg.worker_id)
        self._next_seq[msg.worker_id] = (msg.session, msg.seq + 1)
        held = self._blocks.setdefault(msg.worker_id, set())
        speculative = self._speculative.get(msg.worker_id, {})
        for kind, block_hashes in msg.changes:
            if kind == "stored":
                held.update(block_hashes)
                for block_hash in block_hashes:  # confirmed
                    speculative.pop(block_hash, None)
            elif kind == "removed":
                held.difference_update(block_hashes)
                for block_hash in block_hashes:
                    speculative.pop(block_hash, None)
            else:  # cleared
                held.clear()
                speculative.clear()

    def insert_speculative(self, worker_id: str, block_hashes: Sequence[int]) -> None:
        """`block_hashes` were just sent to `worker_id`: held there until confirmed or expired."""
        now = self._clock()
        speculative = self._speculative.setdefault(worker_id, OrderedDict())
        while speculative and next(iter(speculative.values())) <= now:  # the expired ones, oldest first
            speculative.popitem(last=False)
        held = self._blocks.get(worker_id, ())
        for block_hash in block_hashes:
            if block_hash not in held:
                speculative[block_hash] = now + self.speculative_ttl_s
                speculative.move_to_end(block_hash)

    def match(self, worker_id: str, block_hashes: Sequence[int]) -> int:
        """How many of `block_hashes` (a request's, in order) `worker_id` holds from the first on."""
        held = self._blocks.get(worker_id, ())
        speculative = self._speculative.get(worker_id, {})
        now = self._clock()
        num_held = 0
        for block_hash in block_hashes:
            if block_hash not in held and speculative.get(block_hash, now) <= now:
                break
            num_held += 1
        return num_held

    def num_blocks(self, worker_id: str) -> int:
        """The blocks `worker_id`'s events say it holds (speculative ones not counted)."""
        return len(self._blocks.get(worker_id, ()))

    def forget(self, worker_id: str) -> None:
        """Nothing of `worker_id` is kept (it exited, was removed, or restarted)."""
        self._blocks.pop(worker_id, None)
        self._speculative.pop(worker_id, None)
        self._next_seq.pop(worker_id, None)
