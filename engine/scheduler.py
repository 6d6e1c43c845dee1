"""Continuous-batching scheduler with chunked prefill, preemption, prefill
priority and prefill that starts before every image is here.

Pure Python (no torch), vLLM V1 style: a step is
    out = scheduler.schedule()          # which requests, how many tokens each
    sampled = runner.execute(out)       # {request_id: token_id} for chunks that sample
    updates = scheduler.update(out, sampled)
The same object serves pd (prefill and decode), prefill-only and decode-only
workers (`role`), see `update`, `release` and `add_prefilled`.

Invariants
* `running` is sorted by arrival (decodes, and preemption victims, go by
  arrival); `waiting` is FCFS except that preempted requests go back to its
  front. Under `prefill_priority="cost"` the prefills (waiting and running)
  are *taken* in priority order (`PrefillOrder.priority`), the queues stay as they are.
* Images are the `ImageLedger`'s: a request is never scheduled past the
  first placeholder of an image still pending there (`prefill_bound`);
  blocked there it holds only the blocks it has filled and yields its
  budget. How many such requests may hold blocks is `EarlyPrefill.may_wait`'s
  (engine/early_prefill.py: the deadlock bound).
* Only a request the ledger `can_recompute` is preempted: one prefilled on
  another worker with images (decode role) keeps its blocks and waits for
  free ones; when every block is held by such waiters, the latest arrival
  is dropped (`SchedulerOutput.dropped_request_ids`) so the others go on.
* Every request in `running` (and every prefilled request held for KV
  transfer) holds blocks for at least its `num_computed_tokens`; waiting
  requests hold none.
* A running request always has at least one token left to compute
  (`num_computed_tokens < num_tokens`), so each step it is scheduled it
  computes KV and the last chunk samples.
"""
from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from epd.engine.block_manager import BlockManager
from epd.engine.early_prefill import EarlyPrefill
from epd.engine.image_ledger import ImageLedger
from epd.engine.lora.config import fits_adapter_limit
from epd.engine.prefill_order import PrefillOrder
from epd.engine.request import Request, RequestStatus
from epd.engine.scheduler_config import ROLES, SchedulerConfig
from epd.engine.scheduler_output import RequestUpdate, ScheduledRequest, SchedulerOutput
from epd.engine.span_chunks import ChunkSizes
from epd.engine.spec.decode import SpecDecodeStats, add_drafts

@dataclass
class _Step:
    """What `schedule` has picked so far this step."""

    token_budget: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    scheduled_ids: set[str] = field(default_factory=set)
    preempted_ids: list[str] = field(default_factory=list)
    may_admit: bool = True  # False once a waiting request did not fit (head-of-line)

    def take(self, scheduled: ScheduledRequest) -> None:
        self.scheduled.append(scheduled)
        self.scheduled_ids.add(scheduled.request_id)
        self.token_budget -= scheduled.num_new_tokens


class Scheduler:
    """Decides, each step, which requests run and how many tokens each.

    role="pd":       prompt prefill and decode on this worker (pd and aggregated workers).
    role="prefill":  after its prompt is computed and the first token sampled,
        a request leaves `running` as *prefilled* (`RequestUpdate.is_prefilled`)
        but keeps its blocks until `release(request_id)`.
    role="decode":   requests arrive through `add_prefilled`, and, with
        `max_local_prefill_tokens` > 0, short prompts through `add_request`
        (prefilled here, no KV moves); each step then computes at most
        `max_local_prefill_tokens` prompt tokens after its decodes, so a
        local prefill delays the running decodes by one bounded chunk.
    """

    def __init__(self, config: SchedulerConfig, num_blocks: int, role: str = "pd",
                 images: ImageLedger | None = None, max_loras: int = 0,
                 adapter_weights: Callable[[LoRARequest], str | None] | None = None,
                 early_prefill: EarlyPrefill | None = None, whole_mm_spans: bool = False,
                 num_state_snapshots: int = 0, kv_events: bool = False) -> None:
        """`images`: the engine's image ledger (None: a ledger of its own); `early_prefill`:
        the engine's (None: one of the config's `max_num_image_waits`);
        `max_loras`: distinct adapters among the running requests at most (0: no limit);
        `adapter_weights(lora_request)`: which weights of an adapter this worker read (the
        request's `lora_weights`), None when it is not read: its request waits and the next
        may start (no callable: every adapter is read, by name and path); `whole_mm_spans`: span_chunks.py;
        `num_state_snapshots` (a stateful model's prefix hits resume there), `kv_events`: block_manager.py's."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.config, self.role, self.max_loras, self.adapter_weights = config, role, max_loras, adapter_weights
        self.images = images if images is not None else ImageLedger()
        self.early_prefill = early_prefill or EarlyPrefill(max_num_image_waits=config.max_num_image_waits)
        self.block_manager = BlockManager(num_blocks, config.block_size,
                                          config.enable_prefix_caching, num_state_snapshots, kv_events)
        self.chunks = ChunkSizes(self.images, config.max_num_batched_tokens, whole_mm_spans and role != "decode",
                                 self.block_manager.snapshot_cut)
        self.num_cache_tokens = num_blocks * config.block_size
        # A sequence longer than the whole cache could never be scheduled again: the cache bounds the model length too.
        self.max_model_len = min(config.max_model_len or self.num_cache_tokens, self.num_cache_tokens)

        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._prefilled: dict[str, Request] = {}  # prefill role: held until release
        self._requests: dict[str, Request] = {}  # every request not yet finished or released
        self.order = PrefillOrder(config)  # arrival keys and "cost" priorities
        self.num_scheduled_tokens = 0  # every token scheduled so far: the clock of aging
        self._finished_request_ids: list[str] = []  # since the last schedule()
        self._stalled: list[Request] = []  # last schedule(): got no block, cannot be preempted
        self.num_preemptions = 0
        self.spec_decode = SpecDecodeStats()

    # ----------------------------------------------------------------- intake

    def add_request(self, request: Request) -> None:
        """Queue a new request (status WAITING, no blocks). Its images are in
        the ledger already; one still pending there bounds its prefill.
        ValueError as `check` says.
        """
        if self.role == "decode" and not self.config.max_local_prefill_tokens:
            raise ValueError("a decode-only scheduler takes requests through add_prefilled "
                             "(--max-local-prefill-tokens 0)")
        self.check(request)
        if request.status is not RequestStatus.WAITING or request.block_ids \
                or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id} is not a fresh waiting request")
        self._register(request)
        self.waiting.append(request)

    def is_waiting_for_image(self, request: Request) -> bool:
        """Whether an image it needs next is pending (it can compute nothing now)."""
        return self.images.prefill_bound(request) <= request.num_computed_tokens

    def add_prefilled(self, request: Request) -> list[int] | None:
        """Take a request whose prompt KV was computed on a prefill worker.

        Precondition: `request.output_token_ids` holds the token(s) sampled
        there (at least the first) and the request did not stop on them.
        Allocates blocks for its `num_prompt_tokens` tokens and returns their
        ids in order (block i receives prompt positions
        [i * block_size, (i + 1) * block_size)); the caller must write the
        transferred KV into them before the next `schedule()`. The request
        goes straight to `running` with `num_computed_tokens =
        num_prompt_tokens`; its next step decodes. Returns None, changing
        nothing, when blocks or `max_num_seqs` leave no room now, or a
        running request waits for a block (`_stalled`): retry later.
        """
        if self.role == "prefill":
            raise ValueError("a prefill-only scheduler does not take prefilled requests")
        self.check(request)
        if request.num_output_tokens < 1:
            raise ValueError(f"prefilled request {request.request_id} has no sampled token")
        if request.block_ids or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id} already holds KV state")
        if len(self.running) >= self.config.max_num_seqs or any(not r.is_finished for r in self._stalled) \
                or not self._resolve_adapter(request) \
                or not fits_adapter_limit(self.running, request.lora_key, self.max_loras):
            return None
        if not self.block_manager.allocate(request, request.num_prompt_tokens):
            return None
        request.num_computed_tokens = request.num_prompt_tokens
        request.status = RequestStatus.RUNNING
        self._register(request)
        bisect.insort(self.running, request, key=self._arrival_key)
        return list(request.block_ids)

    def check(self, request: Request) -> None:
        """ValueError unless the request may be added: a new id, a prompt that
        is not empty, fits the KV cache and leaves room under max_model_len."""
        if request.request_id in self._requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        num_prompt_tokens = request.num_prompt_tokens
        if num_prompt_tokens == 0:
            raise ValueError(f"request {request.request_id} has an empty prompt")
        if num_prompt_tokens > self.num_cache_tokens:
            raise ValueError(
                f"prompt of {num_prompt_tokens} tokens cannot fit in the KV cache "
                f"({self.block_manager.num_blocks} blocks x {self.config.block_size} tokens "
                f"= {self.num_cache_tokens} tokens)")
        if self.config.max_model_len is not None and num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(f"prompt of {num_prompt_tokens} tokens leaves no room for output "
                             f"under max_model_len={self.config.max_model_len}")
        self.chunks.check(request)

    def _register(self, request: Request) -> None:
        if request.max_model_len is None:
            request.max_model_len = self.max_model_len  # lets max_tokens=None mean "to the end"
        self._requests[request.request_id] = request
        self.order.add(request, self.num_scheduled_tokens)

    def _arrival_key(self, request: Request) -> tuple[float, int]:
        return self.order.arrival_key(request)

    # --------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests within the token and sequence budgets.

        Order: running requests with one token left (decodes, by arrival),
        then prefills: under "fcfs" running ones by arrival, then the waiting
        queue; under "cost" running and waiting together by `PrefillOrder.priority`,
        and a request admitted ahead of a running prefill must leave the
        blocks that prefill's next chunk needs. A prompt longer than the
        remaining budget is chunked at any token (inside an image span too, unless
        `ChunkSizes.whole_mm_spans`), never past the ledger's `prefill_bound`: one blocked there
        is skipped and its budget goes to the next. When blocks run out, a
        running request not yet scheduled this step is preempted (see
        `_allocate_or_preempt`); no waiting request is admitted in a step that preempted,
        nor after one that did not fit (head-of-line: nobody overtakes the request it is its turn to admit).
        A decode-role scheduler gives its prefills at most
        `max_local_prefill_tokens` of the budget a step.
        """
        step = _Step(self.config.max_num_batched_tokens)
        self._stalled = []
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for request in decodes:
            if step.token_budget == 0:
                break
            # (a request preempted for an earlier one in this loop is not RUNNING)
            if request.status is RequestStatus.RUNNING and self._allocate_or_preempt(request, 1, step):
                step.take(self._scheduled(request, 1))
        step.token_budget -= add_drafts(step.scheduled, step.token_budget, self.max_model_len, self.block_manager,
                                        lambda budget: self._blocks_to_go_on(prefills, budget),
                                        self.waiting[0].num_tokens if self.waiting else 0)

        # A decode worker's prompts (local prefills, recomputed preemptions) take at
        # most max_local_prefill_tokens a step: the running decodes wait one bounded chunk.
        held_back = 0
        if self.role == "decode" and self.config.max_local_prefill_tokens:
            held_back = max(0, step.token_budget - self.config.max_local_prefill_tokens)
            step.token_budget -= held_back

        # Prefills, running and waiting, in one order: "fcfs" the running ones by
        # arrival, then the queue; "cost" all by priority, so a short prompt that
        # just arrived takes the budget before a long one's next chunk.
        if self.config.prefill_priority == "fcfs":
            order = prefills + list(self.waiting)
        else:
            order = sorted(prefills + list(self.waiting), key=self.order.priority)
        for i, request in enumerate(order):
            if step.token_budget == 0:
                break
            if request.status is RequestStatus.RUNNING:
                num_new_tokens = self.chunks.size(request, request.num_computed_tokens, step.token_budget)
                if num_new_tokens > 0 and self._allocate_or_preempt(request, num_new_tokens, step):  # <= 0: it waits
                    step.take(self._scheduled(request, num_new_tokens))
            elif step.may_admit and not step.preempted_ids and len(self.running) < self.config.max_num_seqs:
                self._admit(request, step, order[i + 1:])

        step.token_budget += held_back
        num_batched_tokens = self.config.max_num_batched_tokens - step.token_budget
        self.num_scheduled_tokens += num_batched_tokens
        dropped_ids = [self._drop_stalled()] if self._stalled and not step.scheduled else []
        finished_ids, self._finished_request_ids = self._finished_request_ids, []
        return SchedulerOutput(scheduled=step.scheduled, num_batched_tokens=num_batched_tokens,
                               preempted_request_ids=step.preempted_ids, finished_request_ids=finished_ids,
                               dropped_request_ids=dropped_ids, snapshots=self.block_manager.plan_snapshots(step.scheduled))

    def _admit(self, request: Request, step: _Step, later: list[Request]) -> None:
        """Move a waiting request to `running` with its first chunk (from its
        prefix-cache hit up to its `prefill_bound`) if its blocks are free
        beside those the running prefills in `later` need next. One whose
        first image is pending, or that may not wait for images now, stays
        and the next may start (one past `max_loras` adapters, or whose adapter is not read, too);
        one that does not fit stops admission."""
        if not self._resolve_adapter(request) or not fits_adapter_limit(self.running, request.lora_key,
                                                                        self.max_loras):
            return
        computed_block_ids, num_cached_tokens = self.block_manager.get_computed_blocks(request)
        bound = self.images.prefill_bound(request, num_cached_tokens)
        num_new_tokens = self.chunks.size(request, num_cached_tokens, step.token_budget)
        if num_new_tokens <= 0:  # its first image is not here: it holds nothing and waits; or an image
            step.may_admit &= bound <= num_cached_tokens  # it must take whole does not fit: its turn stays
            return
        if bound < request.num_tokens and not self._can_wait_for_images(request, num_cached_tokens):
            return
        reserve = self._blocks_to_go_on(later, step.token_budget - num_new_tokens)
        if not self.block_manager.can_allocate(request, num_new_tokens, computed_block_ids) \
                or self.block_manager.num_free_blocks - reserve \
                < self._num_new_blocks(request, num_new_tokens, computed_block_ids):
            step.may_admit = False  # nobody overtakes the request whose turn it is
            return
        self.block_manager.allocate(request, num_new_tokens, computed_block_ids)
        self.waiting.remove(request)
        if request.status is RequestStatus.WAITING:  # first schedule, not a return
            request.num_cached_tokens = num_cached_tokens
        request.num_computed_tokens = num_cached_tokens
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=self._arrival_key)
        step.take(self._scheduled(request, num_new_tokens))

    def _resolve_adapter(self, request: Request) -> bool:
        """Sets `request.lora_weights` to the weights of its adapter this worker holds now (read
        again after an eviction, they may be new files: its KV is keyed by them, `lora_key`);
        False when the adapter is not read. Called as it starts, before its blocks are hashed."""
        if request.lora_request is None or self.adapter_weights is None:
            return True
        weights = self.adapter_weights(request.lora_request)
        if weights is None:
            return False
        if weights != request.lora_weights:
            request.lora_weights = weights
            self.block_manager.free(request)  # it holds no block yet: this drops its hashes of the old key
        return True

    def _num_new_blocks(self, request: Request, num_new_tokens: int, computed_block_ids: list[int]) -> int:
        """Free blocks admitting `request` takes (prefix hits on cached-free blocks included)."""
        num_held = len(computed_block_ids)
        num_new = self.block_manager.num_blocks_for(num_held * self.config.block_size + num_new_tokens) - num_held
        return num_new + sum(1 for b in computed_block_ids if self.block_manager.ref_count(b) == 0)

    def _blocks_to_go_on(self, later: list[Request], token_budget: int) -> int:
        """Blocks the running prefills in `later` need for their next chunks
        within `token_budget`: admitting a new request ahead of them (under
        "cost") must leave these, so that it never makes them preempt."""
        num_blocks = 0
        for request in later:
            if request.status is not RequestStatus.RUNNING or token_budget <= 0:
                continue
            num_new_tokens = self.chunks.size(request, request.num_computed_tokens, token_budget)
            if num_new_tokens > 0:
                token_budget -= num_new_tokens
                num_blocks += max(0, self.block_manager.num_blocks_for(request.num_computed_tokens + num_new_tokens)
                                  - len(request.block_ids))
        return num_blocks

    def _can_wait_for_images(self, request: Request, num_cached_tokens: int) -> bool:
        """Whether a request that will stop at a missing image may start now (`EarlyPrefill.may_wait`)."""
        num_image_waits = sum(1 for r in self.running if self.images.prefill_bound(r) < r.num_tokens)
        num_blocks = self.block_manager.num_blocks_for(request.num_tokens) \
            - num_cached_tokens // self.config.block_size
        return self.early_prefill.may_wait(num_image_waits, num_blocks, self.block_manager.num_free_blocks)

    def _scheduled(self, request: Request, num_new_tokens: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(request=request, start=start, num_new_tokens=num_new_tokens,
                                is_last_chunk=start + num_new_tokens == request.num_tokens)

    def _allocate_or_preempt(self, request: Request, num_new_tokens: int, step: _Step) -> bool:
        """Allocate for `request`, preempting others until it fits.

        The victim is the most recent arrival not yet scheduled this step
        (`request` at the latest) that the ledger `can_recompute`: a decode
        worker has no embeddings for the images of a request prefilled
        elsewhere, so it never preempts one; asking itself, such a request
        finds no victim, keeps its blocks and waits (`_stalled`).
        Returns False when `request` was preempted or stalled.
        """
        while not self.block_manager.allocate(request, num_new_tokens):
            # `running` is in arrival order: the last unscheduled one is the latest arrival.
            victim = next((r for r in reversed(self.running) if r.request_id not in step.scheduled_ids
                           and self.images.can_recompute(r)), None)
            if victim is None:
                self._stalled.append(request)
                return False
            self._preempt(victim)
            step.preempted_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _drop_stalled(self) -> str:
        """Every block is held by requests that wait for one and cannot be
        recomputed here: the latest arrival of them finishes as aborted (its
        caller may retry it elsewhere), so the others go on. Returns its id."""
        request = max(self._stalled, key=self._arrival_key)
        self._stalled.remove(request)
        self.running.remove(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request.request_id

    def _preempt(self, request: Request) -> None:
        """Recompute later: drop KV, back to the front of `waiting`."""
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.draft_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ----------------------------------------------------------------- update

    def update(self, output: SchedulerOutput,
               sampled_token_ids: Mapping[str, int | Sequence[int]]) -> list[RequestUpdate]:
        """Apply a finished model step: per scheduled request `num_computed_tokens +=
        num_new_tokens` (less rejected draft tokens, whose blocks go back) and newly full
        blocks enter the prefix cache; a last chunk's `sampled_token_ids[request_id]` (a
        token, or a draft's accepted prefix and the target's token) is appended, the stop
        rules after each (`Request.append_tokens`; other entries are ignored). Finished
        requests free their blocks; in the prefill role an unfinished request that sampled
        becomes prefilled (keeps its blocks). Requests aborted between `schedule` and
        `update` are skipped. Returns one RequestUpdate per request that sampled, in order.
        """
        updates: list[RequestUpdate] = []
        for scheduled in output.scheduled:
            request = scheduled.request
            if self._requests.get(request.request_id) is not request \
                    or request.status is not RequestStatus.RUNNING:
                continue
            assert request.num_computed_tokens == scheduled.start, "stale SchedulerOutput"
            token_ids = scheduled.sampled(sampled_token_ids)
            num_rejected = self.spec_decode.record(scheduled.draft_token_ids, token_ids)
            request.num_computed_tokens += scheduled.num_new_tokens - num_rejected
            self.block_manager.cache_blocks(request)
            if not scheduled.is_last_chunk:
                continue
            status, new_token_ids = request.append_tokens(token_ids, self.max_model_len)
            if status is not None:
                self._finish(request, status)
            elif self.role == "prefill":
                self._prefilled[request.request_id] = request
            else:
                self.block_manager.shrink(request, request.num_tokens)  # the blocks of rejected draft tokens
            updates.append(RequestUpdate(request.request_id, new_token_ids, None if status is None else status.value,
                                         is_prefilled=request.request_id in self._prefilled))
        self.running = [r for r in self.running if r.status is RequestStatus.RUNNING
                        and r.request_id not in self._prefilled]
        return updates

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Mark finished and free blocks; the caller drops it from `running`."""
        request.status = status
        self.block_manager.free(request)
        self._forget(request)

    def _forget(self, request: Request) -> None:
        del self._requests[request.request_id]
        self.order.forget(request.request_id)
        self._finished_request_ids.append(request.request_id)

    # ---------------------------------------------------------- abort/release

    def abort(self, request_ids: Iterable[str]) -> list[str]:
        """Finish requests as FINISHED_ABORTED wherever they are (waiting,
        running or prefilled) and free their blocks. Unknown or already
        finished ids are ignored; returns the ids actually aborted."""
        aborted = []
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is None:
                continue
            if request_id in self._prefilled:
                del self._prefilled[request_id]
            elif request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            aborted.append(request_id)
        return aborted

    def release(self, request_id: str) -> None:
        """Prefill role: free a prefilled request's blocks once its KV was
        transferred and acknowledged. The request is then forgotten here; its
        status stays RUNNING (it lives on, on the decode worker)."""
        request = self._prefilled.pop(request_id, None)
        if request is None:
            raise ValueError(f"request {request_id!r} is not held as prefilled")
        self.block_manager.free(request)
        self._forget(request)

    # ------------------------------------------------------------------ state

    def has_unfinished(self) -> bool:
        """Whether a step has work to do: prefilled requests need none, nor do
        requests waiting for an image (`is_waiting_for_image`)."""
        return any(not self.is_waiting_for_image(r) for r in (*self.running, *self.waiting))

    @property
    def num_waiting_for_images(self) -> int:
        """Requests (running or waiting) that cannot go on until an image arrives."""
        return sum(1 for r in (*self.running, *self.waiting) if self.is_waiting_for_image(r))

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_prefilled(self) -> int:
        return len(self._prefilled)

    def stats(self) -> dict[str, int | float | list[int]]:
        blocks = self.block_manager
        return {"num_running": self.num_running, "num_waiting": self.num_waiting,
                "num_prefilled": self.num_prefilled, "num_preemptions": self.num_preemptions,
                "prefix_cache_queries": blocks.prefix_cache_queries, "prefix_cache_hits": blocks.prefix_cache_hits,
                "kv_usage": blocks.usage, "num_free_blocks": blocks.num_free_blocks, **self.spec_decode.as_dict()}
