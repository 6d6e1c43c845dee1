"""KVEventLog: the block manager's prefix-cache changes since the last step, as
vLLM's KV events (transport/wire/kv_events.py), for the worker to publish.

Pure Python like the block manager that feeds it: `stored` when full blocks
are registered (`cache_blocks`), `removed` when a cached block is evicted,
`cleared` on `reset_prefix_cache`; `take` hands the step's events over.
Replayed in order, they rebuild exactly the set of hashes the block manager
can hit (tests/unit/engine/test_kv_events.py).
"""
from __future__ import annotations

from collections.abc import Sequence

from epd.engine.request import Request
from epd.transport.wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, \
    external_block_hash


class KVEventLog:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVCacheEvent] = []

    def stored(self, request: Request, block_hashes: Sequence[bytes], indexes: Sequence[int]) -> None:
        """The request's blocks at `indexes` (ascending) were registered under `block_hashes[i]`:
        one BlockStored per run of consecutive ones, its parent the block before the run."""
        runs: list[list[int]] = []
        for i in indexes:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        lora = request.lora_request
        for run in runs:
            start, end = run[0] * self.block_size, (run[-1] + 1) * self.block_size
            extra_keys = [self._extra_keys(request, i) for i in run]
            self._events.append(BlockStored(
                block_hashes=[external_block_hash(block_hashes[i]) for i in run],
                parent_block_hash=external_block_hash(block_hashes[run[0] - 1]) if run[0] else None,
                token_ids=list(request.all_token_ids[start:end]), block_size=self.block_size,
                lora_id=None if lora is None else lora.lora_int_id,
                lora_name=None if lora is None else lora.lora_name,
                extra_keys=extra_keys if any(keys is not None for keys in extra_keys) else None))

    def _extra_keys(self, request: Request, index: int) -> tuple | None:
        """What besides its tokens went into block `index`'s hash, as vLLM lists it: the
        adapter's name, then `(mm_hash, offset from the block's start)` per item it holds."""
        start = index * self.block_size
        end = start + self.block_size
        keys: list = [] if request.lora_request is None else [request.lora_request.lora_name]
        keys += [(span.mm_hash, span.offset - start) for span in request.mm_spans
                 if span.offset < end and span.end > start]
        return tuple(keys) or None

    def removed(self, block_hash: bytes) -> None:
        """An evicted block; consecutive evictions share one BlockRemoved."""
        if self._events and isinstance(self._events[-1], BlockRemoved):
            self._events[-1].block_hashes.append(external_block_hash(block_hash))
        else:
            self._events.append(BlockRemoved([external_block_hash(block_hash)]))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        """The events since the last `take`, oldest first."""
        events, self._events = self._events, []
        return events
