"""Which block boundaries have a state snapshot: the prefix cache of a model whose layers carry
per-request state (docs/decisions/state-snapshots.md).

Pure Python (no torch): the block manager decides where snapshots are taken and which one a
prefix hit resumes from; the runner's `SnapshotPool` (engine/state_cache.py) holds the tensors,
index for index.

A snapshot is one request's state (every state-carrying layer's conv and recurrent state) after
the last token of a full block, keyed by that block's chained hash (engine/block_hash.py
`hash_block`): a later request whose hash chain reaches that block may start its slot from it.
Invariants
* An index is in exactly one place: free, pending (taken this step, its copy written after the
  step's forward, not findable until `commit`: as a KV block's hash, registered once computed)
  or cached (findable, least recently used first).
* The runner restores before a step's forward and saves after it, so an index restored and
  taken again in one step is read before it is overwritten.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SnapshotPlan:
    """One step's copies, request id -> snapshot index: `restores` start a prefix hit's slot from
    a snapshot before the forward, `saves` copy a slot into one after it."""

    restores: dict[str, int] = field(default_factory=dict)
    saves: dict[str, int] = field(default_factory=dict)


class StateSnapshots:
    def __init__(self, num_snapshots: int) -> None:
        if num_snapshots < 1:
            raise ValueError(f"num_snapshots must be positive, got {num_snapshots}")
        self.num_snapshots = num_snapshots
        self._free = list(range(num_snapshots - 1, -1, -1))  # popped from the end: index 0 first
        self._cached: OrderedDict[bytes, int] = OrderedDict()  # block hash -> index, LRU first
        self._pending: dict[bytes, int] = {}  # taken this step, written after its forward
        self.num_saved = 0  # snapshots committed
        self.num_restored = 0  # prefix hits that started a slot from one

    def __contains__(self, block_hash: bytes) -> bool:
        """Whether a committed snapshot holds the state after this block (pending ones do not count)."""
        return block_hash in self._cached

    def has(self, block_hash: bytes) -> bool:
        """Whether a snapshot of this block is cached or being written: no need to take one."""
        return block_hash in self._cached or block_hash in self._pending

    def restore(self, block_hash: bytes) -> int:
        """The index of the committed snapshot of this block, now the most recently used."""
        self._cached.move_to_end(block_hash)
        self.num_restored += 1
        return self._cached[block_hash]

    def take(self, block_hash: bytes) -> int | None:
        """An index for a new snapshot of this block (a free one, else the least recently used
        cached one's), pending until `commit`; None when every index is pending this step."""
        assert not self.has(block_hash), "a snapshot of this block exists"
        if self._free:
            index = self._free.pop()
        elif self._cached:
            _, index = self._cached.popitem(last=False)
        else:
            return None
        self._pending[block_hash] = index
        return index

    def commit(self, block_hash: bytes) -> None:
        """The step's forward ran and this block's snapshot was written: later hits may resume there
        (not pending: nothing, e.g. after `clear`)."""
        index = self._pending.pop(block_hash, None)
        if index is not None:
            self._cached[block_hash] = index
            self.num_saved += 1

    def drop_pending(self) -> None:
        """A step failed before `commit`: its pending indices go back, unwritten."""
        self._free.extend(self._pending.values())
        self._pending.clear()

    def discard(self, block_hash: bytes) -> None:
        """Forget one cached snapshot (a newer one of the same request replaces it); unknown: nothing."""
        index = self._cached.pop(block_hash, None)
        if index is not None:
            self._free.append(index)

    def clear(self) -> None:
        """Forget every snapshot (the prefix cache was reset)."""
        self._free.extend(self._cached.values())
        self._free.extend(self._pending.values())
        self._cached.clear()
        self._pending.clear()

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_free(self) -> int:
        return len(self._free)
