"""EncoderPool between a real orchestrator (its registry, routing and fail-over)
and a supervisor that records the two calls the pool may make, on a synthetic
clock: when an encoder is added, how one is drained before it is removed, and
what /metrics shows. Starting real encoder processes is the end-to-end test's
job (tests/e2e/serve/test_encoder_autoscale.py)."""
from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from epd.config import ServeConfig
from epd.serve.attempt import Attempt, Lost
from epd.processes.autoscale import EncoderScaling
from epd.processes.encoder_pool import DRAIN_SETTLE_S, DRAIN_TIMEOUT_S, EncoderPool
from epd.serve.orchestrator import Orchestrator
from epd.transport.wire.messages import Ready, WorkerStats
from epd.transport.wire.wire_values import EncoderCounters

SCALING = EncoderScaling(1, 3, scale_up_queue_s=1.0, scale_up_window_s=0.0, idle_s=5.0, cooldown_s=1.0)


class RecordingSupervisor:
    """The supervision interface the pool is written against (LocalSupervisor and
    the Ray supervisor implement it), recording what it was asked."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []
        self._next = 1

    def add_worker(self, role) -> str:
        worker_id = f"{role}-{self._next}"
        self._next += 1
        self.calls.append(("add", worker_id))
        return worker_id

    def remove_worker(self, worker_id: str) -> None:
        self.calls.append(("remove", worker_id))


class Clock:
    def __init__(self):
        self.now = time.monotonic()  # near the registry's own clock, which judges heartbeats

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def setup(tiny_model, tmp_path):
    orchestrator = Orchestrator(ServeConfig(model=tiny_model), "ipc:///unused", str(tmp_path))
    clock, supervisor = Clock(), RecordingSupervisor()
    pool = EncoderPool(SCALING, supervisor, orchestrator, start_timeout_s=60.0, clock=clock)
    orchestrator.metrics.register(pool)
    return orchestrator, pool, supervisor, clock


def ready(orchestrator: Orchestrator, worker_id: str) -> None:
    orchestrator.registry.on_ready(Ready(worker_id, "encoder", f"ipc:///tmp/x/{worker_id}.sock", "h"))


def stats(orchestrator: Orchestrator, clock: Clock, worker_id: str, queued: int = 0, oldest_s: float = 0.0,
          answered: int = 0) -> None:
    orchestrator.registry.on_stats(WorkerStats(worker_id, "encoder", 0, queued, 0, 0, queued,
                                               encoder=EncoderCounters(num_images=answered, oldest_queued_s=oldest_s)))
    orchestrator.registry.workers[worker_id].last_seen_s = clock.now  # it arrived "now" on the synthetic clock


def metrics(orchestrator: Orchestrator) -> dict[str, float]:
    text = orchestrator.metrics_text().decode()
    return {f"{s.name}{s.labels.get('direction', '')}": s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name.startswith(("epd:encoders", "epd:encoder_scaling"))}


def test_a_backlog_adds_one_encoder_and_nothing_more_until_it_registers(setup):
    orchestrator, pool, supervisor, clock = setup
    ready(orchestrator, "encoder-0")
    stats(orchestrator, clock, "encoder-0", queued=5, oldest_s=2.0)
    pool.tick()
    assert supervisor.calls == [("add", "encoder-1")]
    assert metrics(orchestrator) == {"epd:encoders": 1, "epd:encoder_scaling_decisions_totalup": 1,
                                     "epd:encoder_scaling_decisions_totaldown": 0}
    for _ in range(3):  # the backlog lasts, the cooldown passes, but encoder-1 is still starting
        clock.now += 2.0
        stats(orchestrator, clock, "encoder-0", queued=5, oldest_s=2.0)
        pool.tick()
    assert supervisor.calls == [("add", "encoder-1")]
    ready(orchestrator, "encoder-1")  # registered: routed to, and counted
    assert [w.worker_id for w in orchestrator.registry.live("encoder")] == ["encoder-0", "encoder-1"]
    assert metrics(orchestrator)["epd:encoders"] == 2


def test_an_idle_encoder_is_drained_before_it_is_removed_and_its_work_sent_again(setup):
    orchestrator, pool, supervisor, clock = setup
    for w in ("encoder-0", "encoder-1"):
        ready(orchestrator, w)
        stats(orchestrator, clock, w)
    pool.tick()
    clock.now += SCALING.idle_s
    stats(orchestrator, clock, "encoder-0", answered=1)  # encoder-0 worked meanwhile; encoder-1 is idle
    stats(orchestrator, clock, "encoder-1")
    pool.tick()
    # retired: no new image goes to it, and /health does not miss it
    assert [w.worker_id for w in orchestrator.registry.live("encoder")] == ["encoder-0"]
    assert metrics(orchestrator)["epd:encoders"] == 1 and "encoder" not in orchestrator.missing_roles()
    assert supervisor.calls == []  # not stopped before its stats say it has nothing left
    # an image sent to it just before the retire: a try that still needs it
    attempt = Attempt("req-1", asyncio.Queue(), orchestrator.registry.workers["encoder-0"], None, 100,
                      encoders=[orchestrator.registry.workers["encoder-1"]])
    orchestrator.attempts["req-1"] = attempt
    clock.now += DRAIN_SETTLE_S
    stats(orchestrator, clock, "encoder-1", queued=1, oldest_s=0.1)  # the image arrived: wait
    pool.tick()
    assert supervisor.calls == []
    clock.now += 0.25
    stats(orchestrator, clock, "encoder-1", answered=1)  # done with it: empty
    pool.tick()
    assert supervisor.calls == [("remove", "encoder-1")]
    assert "encoder-1" not in orchestrator.registry.workers
    assert attempt.queue.get_nowait() == Lost("encoder-1", "encoder")  # sent again: removed on purpose, no suspect
    assert metrics(orchestrator)["epd:encoder_scaling_decisions_totaldown"] == 1


def test_a_retired_encoder_that_never_empties_is_removed_after_the_drain_timeout(setup):
    orchestrator, pool, supervisor, clock = setup
    for w in ("encoder-0", "encoder-1"):
        ready(orchestrator, w)
        stats(orchestrator, clock, w)
    pool.tick()
    clock.now += SCALING.idle_s
    stats(orchestrator, clock, "encoder-0", answered=1)
    stats(orchestrator, clock, "encoder-1")
    pool.tick()
    retired_s = clock.now
    while clock.now + 5.0 < retired_s + DRAIN_TIMEOUT_S:
        clock.now += 5.0
        stats(orchestrator, clock, "encoder-0", answered=int(clock.now))
        stats(orchestrator, clock, "encoder-1", queued=2, oldest_s=1.0)  # stuck with work
        pool.tick()
        assert supervisor.calls == []
    clock.now = retired_s + DRAIN_TIMEOUT_S
    pool.tick()
    assert supervisor.calls == [("remove", "encoder-1")]


def test_an_added_encoder_that_never_registers_is_removed(setup):
    orchestrator, pool, supervisor, clock = setup
    ready(orchestrator, "encoder-0")
    stats(orchestrator, clock, "encoder-0", queued=5, oldest_s=2.0)
    pool.tick()
    clock.now += 61.0
    stats(orchestrator, clock, "encoder-0", queued=5, oldest_s=2.0)
    pool.tick()
    assert supervisor.calls[:2] == [("add", "encoder-1"), ("remove", "encoder-1")]
