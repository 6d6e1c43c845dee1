"""Carrying out the encoder autoscaler's decisions (`--encoders MIN-MAX`).

Every TICK_S: the live encoders' latest WorkerStats (the registry) ->
EncoderAutoscaler.observe -> a decision:

    up     supervisor.add_worker("encoder"); the new encoder counts as starting
           until its Ready, and takes images from then on (the router reads the registry)
    down   registry.retire(worker): the router sends it no new image; once its
           stats, sent after DRAIN_SETTLE_S, show an empty queue (or DRAIN_TIMEOUT_S
           passed), supervisor.remove_worker(worker) stops it for good and the
           orchestrator forgets it, sending again any try that still needed it

It talks to the supervisor only through `add_worker(role) -> worker id` and
`remove_worker(worker_id)`, which the local launcher's processes and Ray's
actors both offer. It is also a Prometheus collector: `epd:encoders` (encoders
taking images now) and `epd:encoder_scaling_decisions_total{direction}`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from epd.processes.autoscale import DOWN, UP, EncoderAutoscaler, EncoderLoad, EncoderScaling
from epd.transport.wire.roles import Role

log = logging.getLogger("epd.autoscale")

TICK_S = 0.25  # as often as encoders send WorkerStats
DRAIN_SETTLE_S = 0.5  # an EncodeRequest sent just before the retire has arrived by then
DRAIN_TIMEOUT_S = 60.0  # a retired encoder still busy this long is stopped anyway (its tries are sent again)


class EncoderPool:
    def __init__(self, scaling: EncoderScaling, supervisor, orchestrator, start_timeout_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic):
        """`supervisor`: anything with add_worker(role) and remove_worker(worker_id);
        `orchestrator`: its `registry` and `forget_worker`."""
        self.autoscaler = EncoderAutoscaler(scaling)
        self.supervisor = supervisor
        self.orchestrator = orchestrator
        self.registry = orchestrator.registry
        self.start_timeout_s = start_timeout_s
        self.clock = clock
        self.decisions: Counter[str] = Counter({UP: 0, DOWN: 0})
        self._starting: dict[str, float] = {}  # added, not registered yet -> when added
        self._draining: dict[str, float] = {}  # retired, not removed yet -> when retired

    async def run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self.tick()
            except Exception:  # a failed add or remove is logged; the pool keeps watching
                log.exception("encoder autoscaling")

    def tick(self) -> None:
        now = self.clock()
        self._settle_starting(now)
        self._finish_draining(now)
        decision = self.autoscaler.observe(now, self._loads(), num_starting=len(self._starting))
        if decision is None:
            return
        if decision.direction == UP:
            worker_id = self.supervisor.add_worker(Role.ENCODER)  # raises: logged, not counted
            self.decisions[UP] += 1
            self._starting[worker_id] = now
            print(f"EPD: encoders: queues over {self.autoscaler.scaling.scale_up_queue_s:g} s for "
                  f"{self.autoscaler.scaling.scale_up_window_s:g} s: adding {worker_id}", flush=True)
        else:
            self.decisions[DOWN] += 1
            self.registry.retire(decision.worker_id)
            self._draining[decision.worker_id] = now
            print(f"EPD: encoders: {decision.worker_id} idle for {self.autoscaler.scaling.idle_s:g} s: "
                  f"removing it", flush=True)

    def _loads(self) -> list[EncoderLoad]:
        loads, now = [], self.clock()
        for w in self.registry.live(Role.ENCODER):
            counters = w.stats.encoder if w.stats is not None else None
            age_s = now - w.last_seen_s
            if counters is None:
                loads.append(EncoderLoad(w.worker_id, 0.0, 0, 0, age_s))
                continue
            # an image still queued when these stats left has waited since, too
            oldest_s = counters.oldest_queued_s + (age_s if w.stats.queue_depth else 0.0)
            loads.append(EncoderLoad(w.worker_id, oldest_s, w.stats.queue_depth,
                                     counters.num_images + counters.num_errors + counters.num_cache_skips, age_s))
        return loads

    def _settle_starting(self, now: float) -> None:
        for worker_id, since in list(self._starting.items()):
            if worker_id in self.registry.workers:  # registered (Ready)
                del self._starting[worker_id]
            elif now - since > self.start_timeout_s:
                log.warning("added encoder %s did not register within %g s: removing it", worker_id,
                            self.start_timeout_s)
                del self._starting[worker_id]
                self.supervisor.remove_worker(worker_id)

    def _finish_draining(self, now: float) -> None:
        for worker_id, since in list(self._draining.items()):
            info = self.registry.workers.get(worker_id)
            is_drained = info is None or info.is_dead or (
                info.last_seen_s - since >= DRAIN_SETTLE_S and info.stats is not None
                and info.stats.queue_depth == 0)
            if not is_drained and now - since < DRAIN_TIMEOUT_S:
                continue
            del self._draining[worker_id]
            self.supervisor.remove_worker(worker_id)
            self.orchestrator.forget_worker(worker_id)

    # ------------------------------------------------------------ metrics

    def collect(self):
        count = GaugeMetricFamily("epd:encoders", "Encoders taking images now (autoscaled: --encoders MIN-MAX).")
        count.add_metric([], len(self.registry.live(Role.ENCODER)))
        yield count
        decisions = CounterMetricFamily("epd:encoder_scaling_decisions",
                                        "Encoder autoscaling decisions: an encoder added (up) or removed (down).",
                                        labels=["direction"])
        for direction in (UP, DOWN):
            decisions.add_metric([direction], self.decisions[direction])
        yield decisions


def start_encoder_pool(config, supervisor, orchestrator) -> asyncio.Task | None:
    """With `--encoders MIN-MAX` (config.encoder_scaling): the pool's task, its
    metrics rendered on /metrics. None for a fixed count."""
    if config.encoder_scaling is None:
        return None
    pool = EncoderPool(config.encoder_scaling, supervisor, orchestrator, start_timeout_s=config.ready_timeout_s)
    orchestrator.metrics.register(pool)
    s = config.encoder_scaling
    print(f"EPD: encoders scale between {s.min_encoders} and {s.max_encoders} (up: queues over "
          f"{s.scale_up_queue_s:g} s for {s.scale_up_window_s:g} s; down: idle {s.idle_s:g} s; "
          f"cooldown {s.cooldown_s:g} s)", flush=True)
    return asyncio.create_task(pool.run())
