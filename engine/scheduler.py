"""FCFS continuous-batching scheduler with chunked prefill and preemption.

Pure Python (no torch), vLLM V1 style: a step is
    out = scheduler.schedule()          # which requests, how many tokens each
    sampled = runner.execute(out)       # {request_id: token_id} for chunks that sample
    updates = scheduler.update(out, sampled)
The same object serves combined, prefill-only and decode-only workers
(`role`), see `update`, `release` and `add_prefilled`.

Invariants
* `running` is sorted by arrival (FCFS priority); `waiting` is FCFS except
  that preempted requests go back to its front.
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

ROLES = ("combined", "prefill", "decode")


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

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")


class Scheduler:
    """Decides, each step, which requests run and how many tokens each.

    role="combined": prompt prefill and decode on this worker.
    role="prefill":  after its prompt is computed and the first token sampled,
        a request leaves `running` as *prefilled* (`RequestUpdate.is_prefilled`)
        but keeps its blocks until `release(request_id)`.
    role="decode":   requests arrive through `add_prefilled` only.
    """

    def __init__(self, config: SchedulerConfig, num_blocks: int, role: str = "combined") -> None:
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
        self._num_added = 0
        self._finished_request_ids: list[str] = []  # since the last schedule()
        self._mm_users: dict[str, int] = {}  # mm_hash -> unfinished requests holding it
        self._freed_mm_hashes: dict[str, None] = {}  # since the last schedule(), in order
        self.num_preemptions = 0

    # ----------------------------------------------------------------- intake

    def add_request(self, request: Request) -> None:
        """Queue a new request (status WAITING, no blocks).

        Raises ValueError for a duplicate id, an empty prompt, a prompt
        longer than the KV cache or one leaving no room under max_model_len.
        """
        if self.role == "decode":
            raise ValueError("a decode-only scheduler takes requests through add_prefilled")
        self._check_new(request)
        if request.status is not RequestStatus.WAITING or request.block_ids \
                or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id} is not a fresh waiting request")
        self._register(request)
        self.waiting.append(request)

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
        self._num_added += 1
        for mm_hash in request.mm_hashes:
            self._mm_users[mm_hash] = self._mm_users.get(mm_hash, 0) + 1
            self._freed_mm_hashes.pop(mm_hash, None)  # taken again before the runner dropped it

    def _arrival_key(self, request: Request) -> tuple[float, int]:
        return self._arrival_keys[request.request_id]

    # --------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests within the token and sequence budgets.

        Order: running requests with one token left (decodes), then running
        requests mid-prefill, then waiting requests (FCFS, head-of-line
        blocking). A prompt longer than the remaining budget is chunked at
        any token, also inside an image span. When blocks run out, the most
        recently arrived running request not yet scheduled this step is
        preempted (possibly the one asking); no waiting request is admitted
        in a step that preempted.
        """
        token_budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        scheduled_ids: set[str] = set()
        preempted_ids: list[str] = []

        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for request in decodes + prefills:
            if token_budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted for an earlier request in this loop
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, token_budget)
            if not self._allocate_or_preempt(request, num_new_tokens, scheduled_ids,
                                             preempted_ids):
                continue
            scheduled.append(self._scheduled(request, num_new_tokens))
            scheduled_ids.add(request.request_id)
            token_budget -= num_new_tokens

        while (self.waiting and token_budget > 0 and not preempted_ids
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            computed_block_ids, num_cached_tokens = self.block_manager.get_computed_blocks(request)
            num_new_tokens = min(request.num_tokens - num_cached_tokens, token_budget)
            if not self.block_manager.allocate(request, num_new_tokens, computed_block_ids):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            if request.status is RequestStatus.WAITING:  # first schedule, not a return
                request.num_cached_tokens = num_cached_tokens
            request.num_computed_tokens = num_cached_tokens
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=self._arrival_key)
            scheduled.append(self._scheduled(request, num_new_tokens))
            token_budget -= num_new_tokens

        finished_ids, self._finished_request_ids = self._finished_request_ids, []
        freed_mm_hashes, self._freed_mm_hashes = list(self._freed_mm_hashes), {}
        return SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=self.config.max_num_batched_tokens - token_budget,
            preempted_request_ids=preempted_ids,
            finished_request_ids=finished_ids,
            freed_mm_hashes=freed_mm_hashes)

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
        """Whether a step has work to do (prefilled requests need none)."""
        return bool(self.waiting or self.running)

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
