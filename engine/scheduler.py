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
  are *taken* in priority order (`_priority`), the queues stay as they are.
* A request added with images still missing (`pending_mm_hashes`) is never
  scheduled past the first placeholder of a missing image (`prefill_bound`);
  blocked there it holds only the blocks it has filled and yields its
  budget. At most `max_num_image_waits` such requests hold blocks at once,
  and one is admitted only when the free blocks cover its whole prompt.
* Every request in `running` (and every prefilled request held for KV
  transfer) holds blocks for at least its `num_computed_tokens`; waiting
  requests hold none.
* A running request always has at least one token left to compute
  (`num_computed_tokens < num_tokens`), so each step it is scheduled it
  computes KV and the last chunk samples.
* An image is in use from the moment a request holding it is added until
  the last such request finishes or is released; the next `schedule()`
  then reports it in `freed_mm_hashes` (unless a new request took it again).
"""
from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from epd.engine.block_manager import BlockManager
from epd.engine.request import Request, RequestStatus
from epd.engine.scheduler_output import RequestUpdate, ScheduledRequest, SchedulerOutput

ROLES = ("pd", "prefill", "decode")
PREFILL_PRIORITIES = ("fcfs", "cost")


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling limits chosen at launch.

    The number of KV blocks is discovered at run time (memory profiling), so
    it is a `Scheduler` argument, not a config field. `max_model_len=None`
    means "as long as the KV cache allows".
    """

    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    # Which prefill gets the token budget first: "fcfs" (arrival) or "cost"
    # (fewest tokens left to prefill, aged; see `Scheduler._priority`).
    prefill_priority: str = "cost"
    # Aging of "cost": a request gains `prefill_aging` tokens of priority per
    # token the engine schedules after it arrived.
    prefill_aging: float = 0.1
    # Requests that may hold KV blocks while an image they need is missing.
    max_num_image_waits: int = 4
    # Conditional disaggregation (e-p-d): a text-only prompt of at most this many
    # tokens is prefilled on a decode worker instead of the prefill worker, and a
    # decode worker's step computes at most this many prompt tokens beside its
    # decodes. 0: off (a decode worker takes prefilled requests only).
    max_local_prefill_tokens: int = 512

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_num_image_waits"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.prefill_priority not in PREFILL_PRIORITIES:
            raise ValueError(f"prefill_priority must be one of {', '.join(PREFILL_PRIORITIES)}, "
                             f"got {self.prefill_priority!r}")
        if self.max_local_prefill_tokens < 0:
            raise ValueError(f"max_local_prefill_tokens must be non-negative, got {self.max_local_prefill_tokens}")
        if not self.prefill_aging > 0:
            raise ValueError(f"prefill_aging must be positive, got {self.prefill_aging}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")


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

    def __init__(self, config: SchedulerConfig, num_blocks: int, role: str = "pd") -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.config = config
        self.role = role
        self.block_manager = BlockManager(num_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.num_cache_tokens = num_blocks * config.block_size
        # A sequence longer than the whole cache could never be scheduled
        # again, so the cache bounds the model length too.
        self.max_model_len = min(config.max_model_len or self.num_cache_tokens,
                                 self.num_cache_tokens)

        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._prefilled: dict[str, Request] = {}  # prefill role: held until release
        self._requests: dict[str, Request] = {}  # every request not yet finished or released
        self._arrival_keys: dict[str, tuple[float, int]] = {}
        self._arrival_work: dict[str, int] = {}  # request id -> tokens scheduled before it arrived
        self._missing_mm_hashes: dict[str, set[str]] = {}  # request id -> images not here yet
        self._num_added = 0
        self.num_scheduled_tokens = 0  # every token scheduled so far: the clock of aging
        self._finished_request_ids: list[str] = []  # since the last schedule()
        self._mm_users: dict[str, int] = {}  # mm_hash -> unfinished requests holding it
        self._freed_mm_hashes: dict[str, None] = {}  # since the last schedule(), in order
        self.num_preemptions = 0

    # ----------------------------------------------------------------- intake

    def add_request(self, request: Request, pending_mm_hashes: Iterable[str] = ()) -> None:
        """Queue a new request (status WAITING, no blocks).

        `pending_mm_hashes`: its images whose embeddings are not here yet
        (early prefill). It is prefilled up to the first placeholder of such
        an image, and on after `image_arrived` names it.
        Raises ValueError for a duplicate id, an empty prompt, a prompt
        longer than the KV cache or one leaving no room under max_model_len.
        """
        if self.role == "decode" and not self.config.max_local_prefill_tokens:
            raise ValueError("a decode-only scheduler takes requests through add_prefilled "
                             "(--max-local-prefill-tokens 0)")
        self._check_new(request)
        if request.status is not RequestStatus.WAITING or request.block_ids \
                or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id} is not a fresh waiting request")
        self._register(request)
        missing = set(pending_mm_hashes) & set(request.mm_hashes)
        if missing:
            self._missing_mm_hashes[request.request_id] = missing
        self.waiting.append(request)

    def image_arrived(self, mm_hash: str) -> bool:
        """An image some requests were added without is here: they may be
        prefilled past it. False when no request waits for it."""
        waited = False
        for request_id, missing in list(self._missing_mm_hashes.items()):
            if mm_hash in missing:
                waited = True
                missing.discard(mm_hash)
                if not missing:
                    del self._missing_mm_hashes[request_id]
        return waited

    def prefill_bound(self, request: Request, start: int | None = None) -> int:
        """How far `request` may be computed now: its first placeholder, at or
        after `start` (default: its computed tokens), of an image not here
        yet; else all its tokens."""
        missing = self._missing_mm_hashes.get(request.request_id)
        if not missing:
            return request.num_tokens
        start = request.num_computed_tokens if start is None else start
        for span in request.mm_spans:  # in prompt order
            if span.mm_hash in missing and span.end > start:
                return max(span.offset, start)
        return request.num_tokens

    def is_waiting_for_image(self, request: Request) -> bool:
        """Whether an image it needs next is missing (it can compute nothing now)."""
        return self.prefill_bound(request) <= request.num_computed_tokens
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
        nothing, when blocks or `max_num_seqs` leave no room now: retry later.
        """
        if self.role == "prefill":
            raise ValueError("a prefill-only scheduler does not take prefilled requests")
        self._check_new(request)
        if request.num_output_tokens < 1:
            raise ValueError(f"prefilled request {request.request_id} has no sampled token")
        if request.block_ids or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id} already holds KV state")
        if len(self.running) >= self.config.max_num_seqs:
            return None
        if not self.block_manager.allocate(request, request.num_prompt_tokens):
            return None
        request.num_computed_tokens = request.num_prompt_tokens
        request.status = RequestStatus.RUNNING
        self._register(request)
        bisect.insort(self.running, request, key=self._arrival_key)
        return list(request.block_ids)

    def _check_new(self, request: Request) -> None:
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

    def _register(self, request: Request) -> None:
        if request.max_model_len is None:
            request.max_model_len = self.max_model_len  # lets max_tokens=None mean "to the end"
        self._requests[request.request_id] = request
        self._arrival_keys[request.request_id] = (request.arrival_time, self._num_added)
        self._arrival_work[request.request_id] = self.num_scheduled_tokens
        self._num_added += 1
        for mm_hash in request.mm_hashes:
            self._mm_users[mm_hash] = self._mm_users.get(mm_hash, 0) + 1
            self._freed_mm_hashes.pop(mm_hash, None)  # taken again before the runner dropped it

    def _arrival_key(self, request: Request) -> tuple[float, int]:
        return self._arrival_keys[request.request_id]

    def _priority(self, request: Request) -> tuple[float, tuple[float, int]]:
        """Prefill order under "cost", lowest first: tokens left to prefill
        plus `prefill_aging` x the tokens scheduled before it arrived, i.e.

            priority = (num_tokens - num_computed_tokens) + aging * W_arrival

        A request that arrives W tokens of work after X overtakes X only
        while its own cost is below X's by more than aging x W: X is passed
        only by requests arriving within cost(X) / aging scheduled tokens
        after it (with aging 0.1, a 2,000-token prompt by those arriving
        within the next 20,000 tokens of work), so no prefill starves. Ties
        go by arrival. Under "fcfs" arrival alone."""
        if self.config.prefill_priority == "fcfs":
            return 0.0, self._arrival_key(request)
        cost = request.num_tokens - request.num_computed_tokens
        return (cost + self.config.prefill_aging * self._arrival_work[request.request_id],
                self._arrival_key(request))

    # --------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests within the token and sequence budgets.

        Order: running requests with one token left (decodes, by arrival),
        then prefills: under "fcfs" running ones by arrival, then the waiting
        queue; under "cost" running and waiting together by `_priority`,
        and a request admitted ahead of a running prefill must leave the
        blocks that prefill's next chunk needs. A prompt longer than the
        remaining budget is chunked at any token, also inside an image span,
        and never past `prefill_bound`: a request blocked there is skipped
        and its budget goes to the next. When blocks run out, the most
        recently arrived running request not yet scheduled this step is
        preempted (possibly the one asking); no waiting request is admitted
        in a step that preempted, nor after one that did not fit
        (head-of-line: nobody overtakes the request it is its turn to admit).
        A decode-role scheduler gives its prefills at most
        `max_local_prefill_tokens` of the budget a step.
        """
        token_budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        scheduled_ids: set[str] = set()
        preempted_ids: list[str] = []

        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for request in decodes:
            if token_budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted for an earlier request in this loop
            if self._allocate_or_preempt(request, 1, scheduled_ids, preempted_ids):
                scheduled.append(self._scheduled(request, 1))
                scheduled_ids.add(request.request_id)
                token_budget -= 1

        # A decode worker's prompts (local prefills, recomputed preemptions) take at
        # most max_local_prefill_tokens a step: the running decodes wait one bounded chunk.
        held_back = 0
        if self.role == "decode" and self.config.max_local_prefill_tokens:
            held_back = max(0, token_budget - self.config.max_local_prefill_tokens)
            token_budget -= held_back

        # Prefills, running and waiting, in one order: "fcfs" the running ones by
        # arrival, then the queue; "cost" all by priority, so a short prompt that
        # just arrived takes the budget before a long one's next chunk.
        if self.config.prefill_priority == "fcfs":
            order = prefills + list(self.waiting)
        else:
            order = sorted(prefills + list(self.waiting), key=self._priority)
        num_image_waits = sum(1 for r in self.running if self.prefill_bound(r) < r.num_tokens)
        may_admit = True
        for i, request in enumerate(order):
            if token_budget == 0:
                break
            if request.status is RequestStatus.RUNNING:
                num_new_tokens = min(self.prefill_bound(request) - request.num_computed_tokens, token_budget)
                if num_new_tokens <= 0:
                    continue  # waiting for an image: its budget goes to the others
                if self._allocate_or_preempt(request, num_new_tokens, scheduled_ids, preempted_ids):
                    scheduled.append(self._scheduled(request, num_new_tokens))
                    scheduled_ids.add(request.request_id)
                    token_budget -= num_new_tokens
                continue
            if preempted_ids or not may_admit or len(self.running) >= self.config.max_num_seqs:
                continue  # no admission in a step that preempted, nor past one that did not fit
            computed_block_ids, num_cached_tokens = self.block_manager.get_computed_blocks(request)
            bound = self.prefill_bound(request, num_cached_tokens)
            num_new_tokens = min(bound - num_cached_tokens, token_budget)
            if num_new_tokens <= 0:
                continue  # its first image is not here: it holds nothing and waits
            is_partial = bound < request.num_tokens
            if is_partial and not self._can_wait_for_images(request, num_cached_tokens, num_image_waits):
                continue
            reserve = self._blocks_to_go_on(order[i + 1:], token_budget - num_new_tokens)
            if not self.block_manager.can_allocate(request, num_new_tokens, computed_block_ids) \
                    or self.block_manager.num_free_blocks - reserve \
                    < self._num_new_blocks(request, num_new_tokens, computed_block_ids):
                may_admit = False  # nobody overtakes the request whose turn it is
                continue
            self.block_manager.allocate(request, num_new_tokens, computed_block_ids)
            self.waiting.remove(request)
            num_image_waits += is_partial
            if request.status is RequestStatus.WAITING:  # first schedule, not a return
                request.num_cached_tokens = num_cached_tokens
            request.num_computed_tokens = num_cached_tokens
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=self._arrival_key)
            scheduled.append(self._scheduled(request, num_new_tokens))
            scheduled_ids.add(request.request_id)
            token_budget -= num_new_tokens

        token_budget += held_back
        num_batched_tokens = self.config.max_num_batched_tokens - token_budget
        self.num_scheduled_tokens += num_batched_tokens
        finished_ids, self._finished_request_ids = self._finished_request_ids, []
        freed_mm_hashes, self._freed_mm_hashes = list(self._freed_mm_hashes), {}
        return SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=num_batched_tokens,
            preempted_request_ids=preempted_ids,
            finished_request_ids=finished_ids,
            freed_mm_hashes=freed_mm_hashes)

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
            num_new_tokens = min(self.prefill_bound(request) - request.num_computed_tokens, token_budget)
            if num_new_tokens > 0:
                token_budget -= num_new_tokens
                num_blocks += max(0, self.block_manager.num_blocks_for(request.num_computed_tokens + num_new_tokens)
                                  - len(request.block_ids))
        return num_blocks

    def _can_wait_for_images(self, request: Request, num_cached_tokens: int, num_image_waits: int) -> bool:
        """Whether a request that will stop at a missing image may start now:
        fewer than `max_num_image_waits` others hold blocks waiting for images,
        and the free blocks cover its whole prompt (so starting it never
        preempts a request whose images are all here)."""
        if num_image_waits >= self.config.max_num_image_waits:
            return False
        num_blocks = self.block_manager.num_blocks_for(request.num_tokens) \
            - num_cached_tokens // self.config.block_size
        return num_blocks <= self.block_manager.num_free_blocks

    def _scheduled(self, request: Request, num_new_tokens: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(request=request, start=start, num_new_tokens=num_new_tokens,
                                is_last_chunk=start + num_new_tokens == request.num_tokens)

    def _allocate_or_preempt(self, request: Request, num_new_tokens: int,
                             scheduled_ids: set[str], preempted_ids: list[str]) -> bool:
        """Allocate for `request`, preempting later arrivals until it fits.

        Returns False when `request` itself had to be preempted.
        """
        while not self.block_manager.allocate(request, num_new_tokens):
            # `running` is in arrival order: the last unscheduled one is the
            # most recent arrival we may still evict (`request` at the latest).
            victim = next(r for r in reversed(self.running) if r.request_id not in scheduled_ids)
            self._preempt(victim)
            preempted_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        """Recompute later: drop KV, back to the front of `waiting`."""
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ----------------------------------------------------------------- update

    def update(self, output: SchedulerOutput,
               sampled_token_ids: dict[str, int]) -> list[RequestUpdate]:
        """Apply a finished model step.

        For every scheduled request: `num_computed_tokens += num_new_tokens`
        and newly full blocks enter the prefix cache. For every chunk with
        `is_last_chunk`, `sampled_token_ids[request_id]` is appended and the
        stop rules run (other entries are ignored):
          * EOS (`request.eos_token_ids`, unless `ignore_eos`) or a
            `stop_token_ids` token -> "stop", but only once
            `num_output_tokens >= min_tokens`;
          * `num_output_tokens >= request.max_tokens` or `num_tokens >=
            max_model_len` -> "length".
        Finished requests free their blocks. In the prefill role an unfinished
        request that sampled becomes prefilled (keeps its blocks). Requests
        aborted between `schedule` and `update` are skipped.
        Returns one RequestUpdate per request that sampled, in batch order.
        """
        updates: list[RequestUpdate] = []
        for scheduled in output.scheduled:
            request = scheduled.request
            if self._requests.get(request.request_id) is not request \
                    or request.status is not RequestStatus.RUNNING:
                continue
            assert request.num_computed_tokens == scheduled.start, "stale SchedulerOutput"
            request.num_computed_tokens += scheduled.num_new_tokens
            self.block_manager.cache_blocks(request)
            if not scheduled.is_last_chunk:
                continue
            if request.request_id not in sampled_token_ids:
                raise ValueError(f"no sampled token for request {request.request_id}, "
                                 f"whose chunk ends at its last token")
            token_id = sampled_token_ids[request.request_id]
            request.output_token_ids.append(token_id)
            status = self._check_stop(request)
            if status is not None:
                self._finish(request, status)
                updates.append(RequestUpdate(request.request_id, [token_id], status.value))
            elif self.role == "prefill":
                self._prefilled[request.request_id] = request
                updates.append(RequestUpdate(request.request_id, [token_id], is_prefilled=True))
            else:
                updates.append(RequestUpdate(request.request_id, [token_id]))
        self.running = [r for r in self.running if r.status is RequestStatus.RUNNING
                        and r.request_id not in self._prefilled]
        return updates

    def _check_stop(self, request: Request) -> RequestStatus | None:
        params = request.sampling_params
        token_id = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if (not params.ignore_eos and token_id in request.eos_token_ids) \
                    or token_id in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens \
                or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Mark finished and free blocks; the caller drops it from `running`."""
        request.status = status
        self.block_manager.free(request)
        self._forget(request)

    def _forget(self, request: Request) -> None:
        del self._requests[request.request_id]
        del self._arrival_keys[request.request_id]
        del self._arrival_work[request.request_id]
        self._missing_mm_hashes.pop(request.request_id, None)
        self._finished_request_ids.append(request.request_id)
        for mm_hash in request.mm_hashes:
            self._mm_users[mm_hash] -= 1
            if not self._mm_users[mm_hash]:
                del self._mm_users[mm_hash]
                self._freed_mm_hashes[mm_hash] = None

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

    def stats(self) -> dict[str, int | float]:
        block_manager = self.block_manager
        return {
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "num_prefilled": self.num_prefilled,
            "num_preemptions": self.num_preemptions,
            "prefix_cache_queries": block_manager.prefix_cache_queries,
            "prefix_cache_hits": block_manager.prefix_cache_hits,
            "kv_usage": block_manager.usage,
            "num_free_blocks": block_manager.num_free_blocks,
        }
