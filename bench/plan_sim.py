"""The planner's simulation: one E:P:D split serving a seeded Poisson trace, from service times.

A small deterministic discrete-event model of `epd serve`, torch-free, in
milliseconds. What each worker does (as the real ones do it):
  * encoder    — its images one at a time, first come first served. A
                 request's images go to the encoders in turn (one counter
                 over all images), so four images on two encoders take two
                 encode times, not four.
  * prefill    — one step at a time over the requests whose images are all
                 encoded, first ready first, as many as fit the step's token
                 budget (at least one); the step samples token 1 (the TTFT).
                 The KV then takes `kv_transfer_ms` to reach the decode worker.
  * decode     — continuous batching: a step for every running request, one
                 token each; a request that arrives mid-step joins the next.
                 With conditional disaggregation (e-p-d, `max_local_prefill_tokens`
                 > 0) it also prefills the short text-only prompts routed to it,
                 at most `max_local_prefill_tokens` prompt tokens a step beside
                 its decodes (whole prompts, at least one): the step costs both,
                 so its running requests' decodes stall for the prefill, and the
                 request then decodes there (no KV transfer).
  * pd         — e-pd's combined worker: a step decodes every running
                 request and prefills the ready ones that fit the budget
                 (what is left of it after one token per running request);
                 the step costs both, so a prefill stalls the decodes.
  * aggregated — a pd worker that also encodes its requests' images inline:
                 images that arrived are encoded before the next step, and
                 every running request's decode waits for them.
Requests go to the least loaded worker of a role (requests assigned and not
done; ties to the one given fewest so far), as the orchestrator routes them:
a text-only request skips the encoders, and in e-p-d one of at most
`max_local_prefill_tokens` prompt tokens goes to the least loaded decode
worker, unless no decode worker has room for it in its next step beside the
prompts pending there (sent to it, first token not out) and some prefill
worker has none pending: then to that idle prefill worker (least loaded of
them), through the usual KV transfer (router.idle_prefill_workers, the
orchestrator's own rule). Not modelled: chunking (a step takes whole prompts, first ready
first, as many as fit its budget and at least one; the real scheduler cuts a
prompt at the budget's edge and orders prompts by cost).

The workload may mix in text-only requests (`Workload.text_only_ratio`):
which requests of a seeded trace have no image is what `epd bench serve
--dataset random-mm --seed` draws for that seed (datasets.draw_random_mm),
so a simulated trace and the real one hold the same requests in the same
order; a text-only request's prompt is its text alone (`text_prompt_tokens`).

Service times are a worker's own when it runs alone (`ServiceTimes`).
Without `shared_cores` each worker has a device of its own and runs at that
speed. With it (`epd serve` on a CPU) the times are one thread's, and every
worker runs on the same `cores`: a worker runs as many threads as `epd
serve` gives its role in this split (epd/processes/threads.py, or
`threads_per_worker`), each busy thread gets a share of the cores in
proportion to its CFS weight (from its role's niceness), no worker more
cores than it has threads (weighted water-filling), and a worker on c cores
works c times as fast as one thread. So two one-thread workers on two cores
never slow each other, a third slows all three, and a two-thread worker is
modelled twice as fast as one thread (optimistic where steps are small).

A request's TTFT is arrival to token 1, its TPOT (E2E - TTFT) / (output
tokens - 1), as `bench/metrics.py` defines them; attainment is the share of
requests meeting both SLOs, goodput the highest rate with attainment >= 90%.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from epd.bench.arrivals import arrival_times_s
from epd.bench.plan_inputs import MODES, ServiceTimes, Split, Workload, text_only_requests
from epd.serve.router import idle_prefill_workers
from epd.processes.threads import worker_threads
from epd.transport.wire.roles import Role

ROLES = ("encoder", "prefill", "decode", "pd", "aggregated")
_CFS_WEIGHTS = {-2: 1586, -1: 1277, 0: 1024, 1: 820, 2: 655, 3: 526, 4: 423, 5: 335, 6: 272}  # Linux sched_prio_to_weight
_EPS_MS = 1e-9


@dataclass(frozen=True)
class SimConfig:
    """How the workers run: a device each, or on `cores` shared cores (weighted by niceness
    per role, threads per worker as `epd serve --cpu-sharing` gives them or
    `threads_per_worker`); the engine's token budget a step and `--max-local-prefill-tokens` (0: off)."""

    shared_cores: bool = False
    nice: dict = field(default_factory=lambda: {role: 0 for role in ROLES})
    cores: int = 1
    cpu_sharing: str = "shared"
    threads_per_worker: int | None = None
    max_num_batched_tokens: int = 2048
    max_local_prefill_tokens: int = 512


@dataclass
class _Request:
    arrival_ms: float
    is_text_only: bool
    num_prompt_tokens: int
    images_left: int
    prefill_worker: "_Worker"  # a decode worker when it prefills the request itself
    decode_worker: "_Worker | None"  # None: decoded where it was prefilled (no KV moves)
    tokens_left: int = 0
    ttft_ms: float | None = None
    done_ms: float | None = None


class _Worker:
    def __init__(self, worker_id: str, role: str, weight: int, threads: int = 1):
        self.worker_id, self.role, self.weight, self.threads = worker_id, role, weight, threads
        self.images: list[_Request] = []  # encoder / aggregated: one entry per image, FIFO
        self.ready: list[_Request] = []  # prefill / pd / aggregated: images all encoded, FIFO
        self.running: list[_Request] = []  # decode / pd / aggregated
        self.load = 0  # requests assigned and not done
        self.pending_tokens = 0  # prompt tokens of requests assigned whose first token is not out yet
        self.given = 0  # requests assigned so far (tie-break)
        self.remaining_ms = 0.0  # solo work left in the activity under way
        self.finish = None  # what happens when it ends; None = idle


class _Sim:
    def __init__(self, split: Split, times: ServiceTimes, workload: Workload, config: SimConfig):
        if split.mode not in MODES:
            raise ValueError(f"unknown mode {split.mode!r}")
        self.times, self.workload, self.config = times, workload, config

        front_role = {"aggregated": "aggregated", "e-pd": "pd", "e-p-d": "prefill"}[split.mode]
        counts = {"encoder": split.encoders if split.mode != "aggregated" else 0, front_role: split.prefill,
                  "decode": split.decode if split.mode == "e-p-d" else 0}
        roles = [Role(role) for role, n in counts.items() for _ in range(n)]

        def make(role: str) -> list[_Worker]:
            threads = config.threads_per_worker or worker_threads(Role(role), roles, config.cores, config.cpu_sharing)
            return [_Worker(f"{role}-{i}", role, _CFS_WEIGHTS[config.nice.get(role, 0)], threads)
                    for i in range(counts[role])]

        self.encoders, self.front, self.decoders = make("encoder"), make(front_role), make("decode")
        # the API process: one thread at niceness 0, the request's overhead on it before any worker sees it
        self.api = _Worker("api", "api", _CFS_WEIGHTS[0]) if times.request_overhead_ms or \
            times.text_request_overhead_ms else None
        self.workers = self.encoders + self.front + self.decoders + ([self.api] if self.api else [])
        self.requests: list[_Request] = []
        self.next_encoder = 0
        self.now = 0.0
        self.events: list = []  # heap of (time_ms, seq, callback)
        self.seq = 0

    # -- arrivals and hand-overs --

    def _at(self, time_ms: float, callback) -> None:
        heapq.heappush(self.events, (time_ms, self.seq, callback))
        self.seq += 1

    @staticmethod
    def _least_loaded(workers: list[_Worker]) -> _Worker:
        worker = min(workers, key=lambda w: (w.load, w.given))
        worker.load += 1
        worker.given += 1
        return worker

    def _route(self, num_local_tokens: int) -> tuple[_Worker, _Worker | None]:
        """(the worker that prefills, the decode worker it hands the KV to, or None: it decodes there).
        `num_local_tokens`: a short text-only prompt's tokens (conditional disaggregation), else 0."""
        if num_local_tokens and self.decoders:  # e-p-d: the orchestrator's rule
            pending = {w.worker_id: w.pending_tokens for w in self.workers}
            idle = idle_prefill_workers(self.decoders, self.front, pending, num_local_tokens,
                                        self.config.max_local_prefill_tokens)
            if not idle:
                return self._least_loaded(self.decoders), None  # prefilled where it decodes: no KV moves
            return self._least_loaded(idle), self._least_loaded(self.decoders)
        return self._least_loaded(self.front), self._least_loaded(self.decoders) if self.decoders else None

    def _arrive(self, request_ms: float, is_text_only: bool) -> _Request:
        num_tokens = self.workload.prompt_tokens_of(is_text_only)
        is_local = is_text_only and num_tokens <= self.config.max_local_prefill_tokens
        front, decode = self._route(num_tokens if is_local else 0)
        front.pending_tokens += num_tokens
        images = 0 if is_text_only else self.workload.images_per_request
        request = _Request(request_ms, is_text_only, num_tokens, images, front, decode)
        if not request.images_left:
            front.ready.append(request)  # text-only: no encoder
        for _ in range(request.images_left):
            if front.role == "aggregated":
                front.images.append(request)
            else:
                self.encoders[self.next_encoder % len(self.encoders)].images.append(request)
                self.next_encoder += 1
        return request

    def _prefilled(self, request: _Request) -> None:
        request.ttft_ms = self.now
        request.tokens_left = self.workload.output_len - 1
        request.prefill_worker.pending_tokens -= request.num_prompt_tokens
        if request.decode_worker is not None:
            request.prefill_worker.load -= 1  # its KV leaves for the decode worker
        if request.tokens_left == 0:
            self._done(request)
        elif request.decode_worker is None:
            request.prefill_worker.running.append(request)
        else:
            self._at(self.now + self.times.kv_transfer_ms, lambda: request.decode_worker.running.append(request))

    def _done(self, request: _Request) -> None:
        request.done_ms = self.now
        (request.decode_worker or request.prefill_worker).load -= 1

    # -- what an idle worker starts --

    @staticmethod
    def _take_prefills(worker: _Worker, budget: int) -> list[_Request]:
        taken, tokens = [], 0
        while worker.ready and (not taken or tokens + worker.ready[0].num_prompt_tokens <= budget):
            taken.append(worker.ready.pop(0))
            tokens += taken[-1].num_prompt_tokens
        return taken

    def _start(self, worker: _Worker) -> None:
        times = self.times
        if worker is self.api:  # arrivals in order, one at a time
            if worker.ready:
                arrival_ms, is_text_only = worker.ready.pop(0)
                self._begin(worker, times.request_overhead_of(is_text_only and bool(self.workload.images_per_request)),
                            lambda: self.requests.append(self._arrive(arrival_ms, is_text_only)))
            return
        if worker.images:  # an encoder, or an aggregated worker encoding inline before its next step
            batch = worker.images if worker.role == "aggregated" else worker.images[:1]
            worker.images = worker.images[len(batch):]
            self._begin(worker, times.encode_ms_per_image * len(batch), lambda: self._encoded(batch))
            return
        if worker.role == "encoder":
            return
        running = list(worker.running)
        budget = self.config.max_num_batched_tokens - len(running)
        if worker.role == "decode":  # local prefills only (none routed here when it is off)
            budget = min(budget, self.config.max_local_prefill_tokens)
        prefills = self._take_prefills(worker, budget)
        if not running and not prefills:
            return
        cost = (times.step_overhead_ms + times.decode_ms(len(running))
                + times.prefill_ms(sum(r.num_prompt_tokens for r in prefills)))
        self._begin(worker, cost, lambda: self._stepped(running, prefills))

    def _begin(self, worker: _Worker, cost_ms: float, finish) -> None:
        worker.remaining_ms, worker.finish = cost_ms, finish

    def _encoded(self, batch: list[_Request]) -> None:
        for request in batch:
            request.images_left -= 1
            if request.images_left == 0:
                request.prefill_worker.ready.append(request)

    def _stepped(self, running: list[_Request], prefills: list[_Request]) -> None:
        for request in running:
            request.tokens_left -= 1
            if request.tokens_left == 0:
                (request.decode_worker or request.prefill_worker).running.remove(request)
                self._done(request)
        for request in prefills:
            self._prefilled(request)

    # -- the clock --

    def _speeds(self, busy: list[_Worker]) -> list[float]:
        """Each busy worker's speed: 1 on a device of its own; on shared cores, the cores it
        gets (its threads' weighted share, at most one core a thread: water-filling)."""
        if not self.config.shared_cores:
            return [1.0] * len(busy)
        cores: dict[int, float] = {}
        left, rest = float(self.config.cores), busy
        while rest:
            total = sum(w.threads * w.weight for w in rest)
            full = [w for w in rest if left * w.threads * w.weight / total >= w.threads]
            if not full:  # every one gets its share
                cores.update((id(w), left * w.threads * w.weight / total) for w in rest)
                break
            for w in full:  # as many cores as threads; the others share what is left
                cores[id(w)] = w.threads
                left -= w.threads
            rest = [w for w in rest if id(w) not in cores]
        return [cores[id(w)] for w in busy]

    def run(self, arrivals_ms: list[float], text_only: list[bool]) -> list[_Request]:
        requests = self.requests
        for t, is_text_only in zip(arrivals_ms, text_only, strict=True):
            if self.api is not None:  # through the API process first
                self._at(t, lambda t=t, is_text_only=is_text_only: self.api.ready.append((t, is_text_only)))
            else:
                self._at(t, lambda t=t, is_text_only=is_text_only: requests.append(self._arrive(t, is_text_only)))
        while True:
            while self.events and self.events[0][0] <= self.now + _EPS_MS:
                heapq.heappop(self.events)[2]()
            for worker in self.workers:
                if worker.finish is None:
                    self._start(worker)
            busy = [w for w in self.workers if w.finish is not None]
            if not busy and not self.events:
                break
            speeds = self._speeds(busy)
            step_ms = min((w.remaining_ms / s for w, s in zip(busy, speeds)), default=float("inf"))
            if self.events:
                step_ms = min(step_ms, self.events[0][0] - self.now)
            assert step_ms < float("inf"), "the simulation's clock cannot advance"
            self.now += step_ms
            for worker, speed in zip(busy, speeds):
                worker.remaining_ms -= step_ms * speed
            for worker in busy:
                if worker.remaining_ms <= _EPS_MS:
                    finish, worker.finish = worker.finish, None
                    finish()
        assert all(r.done_ms is not None for r in requests), "the simulation stopped with requests unfinished"
        return requests


@dataclass(frozen=True)
class Outcome:
    """One request in the simulation, as the client would time it (ms)."""

    ttft_ms: float
    tpot_ms: float | None  # None for a one-token output
    is_text_only: bool = False


def simulate(split: Split, times: ServiceTimes, workload: Workload, rate: float, num_requests: int,
             seed: int = 0, config: SimConfig = SimConfig()) -> list[Outcome]:
    """Serve `num_requests` arriving as `epd bench serve --request-rate rate --seed seed` sends them
    (the text-only ones among them, too)."""
    arrivals_ms = [t * 1000.0 for t in arrival_times_s(num_requests, rate, seed=seed)]
    return simulate_arrivals(split, times, workload, arrivals_ms, config,
                             text_only=list(text_only_requests(workload, num_requests, seed)))


def simulate_arrivals(split: Split, times: ServiceTimes, workload: Workload, arrivals_ms: list[float],
                      config: SimConfig = SimConfig(), text_only: list[bool] | None = None) -> list[Outcome]:
    """Serve one request arriving at each of `arrivals_ms` (non-decreasing); outcomes in arrival order.
    `text_only`: which requests have no image (None: those of a workload without images)."""
    if text_only is None:
        text_only = [not workload.images_per_request] * len(arrivals_ms)
    done = _Sim(split, times, workload, config).run(arrivals_ms, text_only)
    n = workload.output_len
    return [Outcome(r.ttft_ms - r.arrival_ms, (r.done_ms - r.ttft_ms) / (n - 1) if n > 1 else None, r.is_text_only)
            for r in done]


def num_met(outcomes: list[Outcome], ttft_slo_ms: float, tpot_slo_ms: float) -> int:
    """Requests meeting both SLOs (a missing TPOT meets it, as in bench/metrics.py)."""
    return sum(o.ttft_ms <= ttft_slo_ms and (o.tpot_ms or 0.0) <= tpot_slo_ms for o in outcomes)


def attainment(outcomes: list[Outcome], ttft_slo_ms: float, tpot_slo_ms: float) -> float:
    """Share of requests meeting both SLOs."""
    return num_met(outcomes, ttft_slo_ms, tpot_slo_ms) / len(outcomes) if outcomes else 0.0


def simulate_traces(split: Split, times: ServiceTimes, workload: Workload, rate: float, *, num_requests: int,
                    seeds: list[int], config: SimConfig = SimConfig()) -> list[Outcome]:
    """One trace per seed (each `num_requests` long, as a real run), outcomes pooled."""
    return [o for seed in seeds for o in simulate(split, times, workload, rate, num_requests, seed, config)]


def predicted_attainment(split: Split, times: ServiceTimes, workload: Workload, rate: float, *,
                         ttft_slo_ms: float, tpot_slo_ms: float, **kwargs) -> float:
    """Attainment over one trace per seed, pooled (`simulate_traces`' arguments)."""
    return attainment(simulate_traces(split, times, workload, rate, **kwargs), ttft_slo_ms, tpot_slo_ms)


def goodput_of(attainment_per_rate: dict[float, float], target: float = 0.9) -> float:
    """The highest rate whose attainment is >= `target`, 0.0 if none."""
    return max((rate for rate, a in attainment_per_rate.items() if a >= target), default=0.0)


def predicted_goodput(split: Split, times: ServiceTimes, workload: Workload, rates: list[float], *,
                      target: float = 0.9, **kwargs) -> tuple[float, dict[float, float]]:
    """(highest of `rates` whose predicted attainment is >= `target`, 0.0 if none; attainment per rate)."""
    per_rate = {rate: predicted_attainment(split, times, workload, rate, **kwargs) for rate in rates}
    return goodput_of(per_rate, target), per_rate


def max_goodput(split: Split, times: ServiceTimes, workload: Workload, *, target: float = 0.9,
                low: float = 1e-3, high: float = 100.0, steps: int = 14, **kwargs) -> float:
    """The highest rate with predicted attainment >= `target`, by bisection between `low` and `high`
    (0.0 if even `low` misses): finer than a grid, for ranking splits."""
    def ok(rate: float) -> bool:
        return predicted_attainment(split, times, workload, rate, **kwargs) >= target

    if not ok(low):
        return 0.0
    if ok(high):
        return high
    for _ in range(steps):
        mid = (low * high) ** 0.5  # rates span decades: bisect in log space
        low, high = (mid, high) if ok(mid) else (low, mid)
    return low
