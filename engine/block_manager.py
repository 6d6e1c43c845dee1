"""Paged KV-cache bookkeeping: fixed-size blocks, reference counts, prefix cache.

Pure Python (no torch): the model runner owns the KV tensors; this class only
decides which block ids a request's tokens live in.

Invariants
* Every block is in exactly one of three states:
  - in use: ref_count > 0 (held by one or more requests);
  - cached-free: ref_count == 0 and it still holds a block hash, so a later
    request with the same prefix can reuse its KV; evicted least recently
    used when a fresh block is needed;
  - free: ref_count == 0 and no hash.
  `num_free_blocks` counts the last two kinds: both can be handed out.
* A block hash is registered only for a FULL block whose KV has been
  computed (`cache_blocks` runs after the model step), so a prefix hit never
  points at KV that is still being written. Rejected draft tokens
  (speculative decoding) never count as computed, so a hash covers accepted
  tokens only; `shrink` hands back the blocks allocated for them.
* Once every request is freed, `num_free_blocks == num_blocks`.
* With state snapshots (a model whose layers carry per-request state,
  engine/state_snapshots.py) a prefix hit ends at a block boundary that has
  a committed snapshot: the KV blocks past the last such boundary are not
  hits (their tokens are computed again, from the snapshot's state).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

from epd.engine.block_hash import prompt_block_hashes, root_block_hash
from epd.engine.kv_event_log import KVEventLog
from epd.engine.request import Request
from epd.engine.scheduler_output import ScheduledRequest
from epd.engine.state_snapshots import SnapshotPlan, StateSnapshots

class BlockManager:
    """Allocates KV blocks to requests; shares full blocks by prefix hash.

    Usage per request, as the scheduler drives it:
      1. first schedule: `block_ids, num_cached_tokens = get_computed_blocks(r)`,
         then `allocate(r, num_new_tokens, block_ids)`;
      2. later chunks / decode steps: `allocate(r, num_new_tokens)`;
      3. after each model step: `cache_blocks(r)` (registers newly full blocks),
         and `shrink(r, r.num_tokens)` after a step that verified a draft;
      4. finish, abort or preemption: `free(r)`.
    `allocate` either succeeds completely or changes nothing. With
    `num_state_snapshots` (and prefix caching on) it also decides where the
    per-request state is snapshotted (`snapshot_cut`, `plan_snapshots`;
    docs/decisions/state-snapshots.md). With `kv_events` it records its prefix-cache
    changes as vLLM's KV events (`kv_events.take()` after each step; engine/kv_event_log.py).
    """

    def __init__(self, num_blocks: int, block_size: int = 16,
                 enable_prefix_caching: bool = True, num_state_snapshots: int = 0,
                 kv_events: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be positive, "
                             f"got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching

        self._ref_counts = [0] * num_blocks
        self._block_hashes: list[bytes | None] = [None] * num_blocks
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        # Cached-free blocks in LRU order: the first key is evicted first.
        self._cached_free_block_ids: OrderedDict[int, None] = OrderedDict()
        self._block_id_by_hash: dict[bytes, int] = {}
        # Per request: its chain of full-block hashes (computed lazily, kept
        # until free) and how many of its blocks went through `cache_blocks`.
        self._request_block_hashes: dict[str, list[bytes]] = {}
        self._num_hashed_blocks: dict[str, int] = {}

        self.prefix_cache_queries = 0  # tokens looked up, counted per admission
        self.prefix_cache_hits = 0  # tokens found

        # A model with per-request state: where its state was snapshotted, by block hash.
        self.snapshots = StateSnapshots(num_state_snapshots) \
            if num_state_snapshots and enable_prefix_caching else None
        self._shared_ends: dict[str, int] = {}  # request id -> the end of the prefix its KV hit shares
        self._latest_snapshots: dict[str, bytes] = {}  # request id -> its latest snapshot past its prompt
        self._restores: dict[str, int] = {}  # admitted since the last plan: request id -> the snapshot it resumes from
        self._pending_snapshots: dict[str, bytes] = {}  # request id -> the snapshot its step is writing
        self.kv_events = KVEventLog(block_size) if kv_events and enable_prefix_caching else None

    # ------------------------------------------------------------------ state

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out: free plus cached-free (evictable)."""
        return len(self._free_block_ids) + len(self._cached_free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def cached_block_hashes(self) -> set[bytes]:
        """The hashes a prefix lookup can hit now."""
        return set(self._block_id_by_hash)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    # ---------------------------------------------------------- prefix lookup

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of `request.all_token_ids`, in full blocks.

        Returns `(block_ids, num_cached_tokens)`. Never covers all tokens: at
        least one token is left to compute so the model has logits to sample
        from, hence the cap at the last block boundary below `num_tokens`.
        Pure lookup: touches no ref count and no counter.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need every prompt position computed (vLLM skips the cache too)
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        block_ids = []
        block_hashes = self._get_block_hashes(request, max_num_blocks)
        for block_hash in block_hashes:
            block_id = self._block_id_by_hash.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        if self.snapshots is not None:  # the state resumes only where a snapshot holds it
            self._shared_ends[request.request_id] = len(block_ids) * self.block_size
            while block_ids and block_hashes[len(block_ids) - 1] not in self.snapshots:
                block_ids.pop()
        return block_ids, len(block_ids) * self.block_size

    def _get_block_hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        """Chained hashes of the request's first `num_full_blocks` blocks."""
        block_hashes = self._request_block_hashes.setdefault(request.request_id, [])
        if len(block_hashes) < num_full_blocks:  # the hash the API's cache-aware router computes too
            block_hashes[:] = prompt_block_hashes(request.all_token_ids, request.mm_spans, self.block_size,
                                                  num_full_blocks, root_block_hash(request.lora_key), block_hashes)
        return block_hashes[:num_full_blocks]

    # -------------------------------------------------------- state snapshots

    def _snapshot_targets(self, request: Request) -> set[int]:
        """Where the request's prompt state is snapshotted: the last block boundary before its
        last token (an equal prompt hits up to there) and the end of the prefix its KV hit shared
        with an earlier request (a shared system prompt: the next one resumes there)."""
        last = (request.num_tokens - 1) // self.block_size * self.block_size
        return {b for b in (last, self._shared_ends.get(request.request_id, 0)) if b > 0}

    def _boundary_hash(self, request: Request, boundary: int) -> bytes:
        return self._get_block_hashes(request, boundary // self.block_size)[-1]

    def snapshot_cut(self, request: Request, start: int, num_new_tokens: int) -> int:
        """`num_new_tokens` of a prefill chunk from `start`, ended at the first snapshot target
        inside it that has no snapshot yet (its state is copied after the step)."""
        if self.snapshots is None:
            return num_new_tokens
        for boundary in sorted(self._snapshot_targets(request)):
            if start < boundary < start + num_new_tokens \
                    and not self.snapshots.has(self._boundary_hash(request, boundary)):
                return boundary - start
        return num_new_tokens

    def snapshot_stats(self) -> dict[str, int]:
        """Snapshots written, and prefix hits that resumed from one (0 and 0: none kept)."""
        snapshots = self.snapshots
        return {"state_snapshots_saved": 0 if snapshots is None else snapshots.num_saved,
                "state_snapshot_hits": 0 if snapshots is None else snapshots.num_restored}

    def plan_snapshots(self, scheduled: Sequence[ScheduledRequest]) -> SnapshotPlan:
        """The step's state copies: restores of the prefix hits admitted (`allocate`), a save for
        each chunk that ends on a block boundary worth a snapshot (`_take_snapshot`), committed
        as its request's blocks are hashed after the step (`cache_blocks`)."""
        if self.snapshots is None:
            return SnapshotPlan()
        self.snapshots.drop_pending()  # a failed step's, never written
        self._pending_snapshots.clear()
        restores, self._restores = self._restores, {}
        saves = {s.request_id: self._take_snapshot(s.request, s.end) for s in scheduled if not s.draft_token_ids}
        return SnapshotPlan(restores, {request_id: index for request_id, index in saves.items() if index is not None})

    def _take_snapshot(self, request: Request, end: int) -> int | None:
        """The snapshot index to copy the request's state into after a step that computes it up
        to `end`, None when none is taken: `end` must be a block boundary, one of its prompt's
        targets or past its prompt (then it replaces the request's previous one there: a
        conversation's next turn resumes from the latest)."""
        if end % self.block_size or end == 0:
            return None
        is_past_prompt = end >= request.num_prompt_tokens
        if not is_past_prompt and end not in self._snapshot_targets(request):
            return None
        block_hash = self._boundary_hash(request, end)
        if self.snapshots.has(block_hash):
            return None
        index = self.snapshots.take(block_hash)
        if index is None:
            return None
        self._pending_snapshots[request.request_id] = block_hash
        if is_past_prompt:
            previous = self._latest_snapshots.get(request.request_id)
            if previous is not None:
                self.snapshots.discard(previous)
            self._latest_snapshots[request.request_id] = block_hash
        return index

    # ------------------------------------------------------------- allocation

    def can_allocate(self, request: Request, num_new_tokens: int,
                     computed_block_ids: Sequence[int] | None = None) -> bool:
        """Whether `allocate` with the same arguments would succeed."""
        return self._num_missing_blocks(request, num_new_tokens, computed_block_ids) \
            <= self.num_free_blocks - self._num_cached_free(computed_block_ids)

    def allocate(self, request: Request, num_new_tokens: int,
                 computed_block_ids: Sequence[int] | None = None) -> bool:
        """Give `request` room for `num_new_tokens` more tokens.

        Without `computed_block_ids` the room is counted from
        `request.num_computed_tokens`. With it (first allocation after
        `get_computed_blocks`, request holds no blocks) the prefix-hit blocks
        are shared (ref count + 1) and room is counted from the tokens they
        cover; the prefix-cache counters are updated. Appends to
        `request.block_ids`. Returns False, changing nothing, when there are
        not enough free blocks.
        """
        if not self.can_allocate(request, num_new_tokens, computed_block_ids):
            return False
        num_missing_blocks = self._num_missing_blocks(request, num_new_tokens, computed_block_ids)
        if computed_block_ids is not None:
            assert not request.block_ids, "computed blocks are only for a first allocation"
            for block_id in computed_block_ids:
                self._touch(block_id)
            request.block_ids.extend(computed_block_ids)
            self._num_hashed_blocks[request.request_id] = len(computed_block_ids)
            if self.enable_prefix_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += len(computed_block_ids) * self.block_size
            if self.snapshots is not None and computed_block_ids:  # its state resumes from the hit's snapshot
                block_hash = self._request_block_hashes[request.request_id][len(computed_block_ids) - 1]
                self._restores[request.request_id] = self.snapshots.restore(block_hash)
        for _ in range(num_missing_blocks):
            request.block_ids.append(self._pop_free_block())
        return True

    def _num_missing_blocks(self, request: Request, num_new_tokens: int,
                            computed_block_ids: Sequence[int] | None) -> int:
        if computed_block_ids is None:
            num_tokens = request.num_computed_tokens + num_new_tokens
            num_held = len(request.block_ids)
        else:
            num_tokens = len(computed_block_ids) * self.block_size + num_new_tokens
            num_held = len(computed_block_ids)
        return max(0, self.num_blocks_for(num_tokens) - num_held)

    def _num_cached_free(self, block_ids: Sequence[int] | None) -> int:
        # A prefix hit on a cached-free block takes it out of the free pool.
        return sum(1 for b in block_ids or () if self._ref_counts[b] == 0)

    def _touch(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            del self._cached_free_block_ids[block_id]
        self._ref_counts[block_id] += 1

    def _pop_free_block(self) -> int:
        # Prefer never-hashed blocks so cached prefixes live as long as possible.
        if self._free_block_ids:
            block_id = self._free_block_ids.popleft()
        else:
            block_id, _ = self._cached_free_block_ids.popitem(last=False)  # LRU
            self._drop_hash(block_id)
        assert self._ref_counts[block_id] == 0
        self._ref_counts[block_id] = 1
        return block_id

    def _drop_hash(self, block_id: int) -> None:
        block_hash = self._block_hashes[block_id]
        if block_hash is not None and self._block_id_by_hash.get(block_hash) == block_id:
            del self._block_id_by_hash[block_hash]
            if self.kv_events is not None:
                self.kv_events.removed(block_hash)
        self._block_hashes[block_id] = None

    # ---------------------------------------------------------------- caching

    def cache_blocks(self, request: Request) -> None:
        """Register hashes of the request's blocks that are now full.

        Call after the model step that computed them (i.e. after
        `request.num_computed_tokens` advanced). When another block already
        holds the same hash (two equal prompts computed side by side), the
        first one stays canonical and this one is simply not cached.
        """
        if not self.enable_prefix_caching:
            return
        pending = self._pending_snapshots.pop(request.request_id, None)
        if pending is not None:  # the state the step left in its slot was copied: findable now
            self.snapshots.commit(pending)
        num_full_blocks = min(request.num_computed_tokens // self.block_size,
                              len(request.block_ids))
        num_hashed = self._num_hashed_blocks.get(request.request_id, 0)
        if num_full_blocks <= num_hashed:
            return
        block_hashes = self._get_block_hashes(request, num_full_blocks)
        stored = []
        for i in range(num_hashed, num_full_blocks):
            block_id = request.block_ids[i]
            block_hash = block_hashes[i]
            if self._block_hashes[block_id] is None and block_hash not in self._block_id_by_hash:
                self._block_hashes[block_id] = block_hash
                self._block_id_by_hash[block_hash] = block_id
                stored.append(i)
        self._num_hashed_blocks[request.request_id] = num_full_blocks
        if self.kv_events is not None and stored:
            self.kv_events.stored(request, block_hashes, stored)

    # ------------------------------------------------------------------- free

    def shrink(self, request: Request, num_tokens: int) -> None:
        """Speculative decoding's rollback: give back the request's blocks past
        those that hold its first `num_tokens` positions (allocated for draft
        tokens the target rejected). They hold no computed token, so they were
        never hashed: they go back to the plain free list, and the slots of
        rejected tokens in the blocks kept are overwritten by the next step."""
        num_kept = self.num_blocks_for(num_tokens)
        while len(request.block_ids) > num_kept:
            block_id = request.block_ids.pop()
            assert self._block_hashes[block_id] is None, "a rejected draft's block was hashed"
            self._ref_counts[block_id] -= 1
            assert self._ref_counts[block_id] == 0, f"block {block_id} of a draft is shared"
            self._free_block_ids.appendleft(block_id)  # reused first: the next draft takes it back

    def free(self, request: Request) -> None:
        """Release the request's blocks; idempotent.

        Blocks are released tail first, so a request's last blocks (least
        likely to be shared) are also the first to be evicted.
        """
        for block_id in reversed(request.block_ids):
            self._ref_counts[block_id] -= 1
            assert self._ref_counts[block_id] >= 0, f"block {block_id} freed twice"
            if self._ref_counts[block_id] == 0:
                if self._block_hashes[block_id] is None:
                    self._free_block_ids.append(block_id)
                else:
                    self._cached_free_block_ids[block_id] = None  # most recently used
        request.block_ids.clear()
        self._request_block_hashes.pop(request.request_id, None)
        self._num_hashed_blocks.pop(request.request_id, None)
        self._shared_ends.pop(request.request_id, None)
        self._latest_snapshots.pop(request.request_id, None)

    def reset_prefix_cache(self) -> None:
        """Forget every block hash (e.g. after new weights are loaded).

        Blocks in use stay allocated; they just stop being shareable.
        """
        for block_id in range(self.num_blocks):
            self._block_hashes[block_id] = None
        self._block_id_by_hash.clear()
        if self.kv_events is not None:
            self.kv_events.cleared()
        self._free_block_ids.extend(self._cached_free_block_ids)
        self._cached_free_block_ids.clear()
        if self.snapshots is not None:
            self.snapshots.clear()
            self._pending_snapshots.clear()
