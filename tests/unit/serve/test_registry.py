"""The API's view of its workers (who counts as alive) and when a dead one is started again."""
from __future__ import annotations

import pytest

from epd.serve.registry import WorkerRegistry
from epd.transport.wire.messages import Alive, Ready, WorkerStats


def _registry(supervised: set[str]) -> WorkerRegistry:
    # a heartbeat timeout of 0: every worker is past it at once, no clock needed
    registry = WorkerRegistry(heartbeat_timeout_s=0.0, supervised=supervised.__contains__)
    for worker_id in ("prefill-0", "encoder@hostb:7000"):
        registry.on_ready(Ready(worker_id, worker_id.split("-")[0].split("@")[0], f"ipc:///x/{worker_id}", "h"))
    return registry


def test_silence_kills_only_the_workers_no_supervisor_here_watches():
    registry = _registry({"prefill-0"})
    assert [w.worker_id for w in registry.live("prefill")] == ["prefill-0"]  # busy, not dead
    assert registry.live("encoder") == []  # an `epd worker` elsewhere: silence is all we know


def test_alive_from_a_busy_worker_keeps_it_live_until_it_is_stuck():
    registry = WorkerRegistry(heartbeat_timeout_s=10.0, stuck_after_s=60.0)
    info = registry.on_ready(Ready("encoder@hostb:7000", "encoder", "tcp://hostb:7000", "hostb"))
    info.last_seen_s -= 11.0  # no stats for 11 s: silent
    assert registry.live("encoder") == []
    registry.on_alive(Alive("encoder@hostb:7000", busy_s=11.0))  # its heartbeat thread: busy, not dead
    assert registry.live("encoder") == [info]
    registry.on_alive(Alive("encoder@hostb:7000", busy_s=61.0))  # busy past the request timeout: stuck
    assert registry.is_stuck(info) and registry.live("encoder") == []
    registry.on_stats(WorkerStats("encoder@hostb:7000", "encoder", 0, 0, 0, 0, 0))  # its loop came back
    assert registry.live("encoder") == [info]
    registry.mark_dead("encoder@hostb:7000")
    registry.on_alive(Alive("encoder@hostb:7000", busy_s=1.0))  # a late beat does not raise the dead
    assert registry.live("encoder") == []


def test_an_encoder_says_which_requests_its_batch_holds_until_its_stats():
    registry = WorkerRegistry(heartbeat_timeout_s=10.0)
    info = registry.on_ready(Ready("encoder-0", "encoder", "ipc:///tmp/e.sock", "h"))
    registry.on_alive(Alive("encoder-0", 0.0, working_on=["req-1", "req-2"]))  # its loop: a batch starts
    assert info.working_on == ("req-1", "req-2")
    registry.on_alive(Alive("encoder-0", 3.0))  # its heartbeat thread says nothing of it
    assert info.working_on == ("req-1", "req-2") and info.busy_s == 3.0
    registry.on_alive(Alive("encoder-0", 0.0, working_on=[]))  # the batch ended
    assert info.working_on == ()
    registry.on_alive(Alive("encoder-0", 0.0, working_on=["req-3"]))
    registry.on_stats(WorkerStats("encoder-0", "encoder", 0, 0, 0, 0, 0))  # between batches
    assert info.working_on == ()


def test_the_heartbeat_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("EPD_HEARTBEAT_TIMEOUT_S", "2.5")
    assert WorkerRegistry().heartbeat_timeout_s == 2.5
    monkeypatch.setenv("EPD_HEARTBEAT_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="EPD_HEARTBEAT_TIMEOUT_S='soon': expected seconds"):
        WorkerRegistry()


def test_a_supervised_worker_is_dead_once_its_exit_is_reported():
    registry = _registry({"prefill-0"})
    registry.mark_dead("prefill-0")
    assert registry.live("prefill") == []


def test_restart_backoff_doubles_then_the_budget_runs_out():
    from epd.processes.supervisor import RestartBudget

    budget = RestartBudget(max_restarts=5, window_s=3600.0)
    assert [budget.next_delay("decode-0") for _ in range(7)] == [0.5, 1.0, 2.0, 4.0, 8.0, None, None]
    assert budget.next_delay("prefill-0") == 0.5  # each process its own
    budget.forget("decode-0")
    assert budget.next_delay("decode-0") == 0.5
    endless = RestartBudget(max_restarts=None, window_s=3600.0)
    assert [endless.next_delay(0) for _ in range(7)][-1] == 8.0


# -- who may speak for a worker id (issue 33) ----------------------------------------------------

SESSION, OTHER = "a" * 32, "b" * 32


def _registered(session: str = SESSION) -> WorkerRegistry:
    registry = WorkerRegistry(heartbeat_timeout_s=10.0)
    registry.on_ready(Ready("decode-0", "decode", "tcp://hosta:7000", "hosta", session=session))
    return registry


def test_a_live_worker_id_is_not_taken_over_by_another_session():
    registry = _registered()
    assert registry.on_ready(Ready("decode-0", "decode", "tcp://evil:6666", "evil", session=OTHER)) is None
    assert registry.workers["decode-0"].inbox == "tcp://hosta:7000"
    again = registry.on_ready(Ready("decode-0", "decode", "tcp://hosta:7000", "hosta", session=SESSION))
    assert again is registry.workers["decode-0"]  # its own re-announcement: a refresh


def test_its_successor_registers_once_it_is_dead_or_silent():
    registry = _registered()
    registry.mark_dead("decode-0")  # the supervisor saw it exit
    info = registry.on_ready(Ready("decode-0", "decode", "tcp://hosta:7000", "hosta", session=OTHER))
    assert info is not None and info.session == OTHER and registry.live("decode") == [info]
    info.last_seen_s -= 11.0  # an unsupervised worker silent past the heartbeat timeout
    successor = registry.on_ready(Ready("decode-0", "decode", "tcp://hostc:7000", "hostc", session=SESSION))
    assert successor is not None and successor.inbox == "tcp://hostc:7000"


def test_stats_and_alive_count_only_from_the_registered_session():
    registry = _registered()
    registry.on_stats(WorkerStats("decode-0", "decode", 9, 9, 0, 1, 9, session=OTHER))  # a forger's load
    assert registry.workers["decode-0"].stats is None
    registry.on_stats(WorkerStats("decode-0", "decode", 1, 0, 0, 1, 0, session=SESSION))
    assert registry.workers["decode-0"].load == 1
    registry.workers["decode-0"].last_seen_s -= 11.0
    assert registry.on_alive(Alive("decode-0", 1.0, session=OTHER)) is None  # cannot keep it alive either
    assert registry.live("decode") == []


def test_a_role_is_down_when_no_worker_of_it_lives_or_is_being_restarted():
    registry = WorkerRegistry(heartbeat_timeout_s=10.0, supervised={"decode-0", "decode-1"}.__contains__)
    for worker_id in ("decode-0", "decode-1"):
        registry.on_ready(Ready(worker_id, "decode", f"ipc:///x/{worker_id}.sock", "h"))
    registry.mark_dead("decode-0", restarting=False)
    assert registry.down_roles(["decode"]) == []  # decode-1 serves
    registry.mark_dead("decode-1", restarting=True)
    assert registry.down_roles(["decode"]) == []  # none live, but one comes back: requests wait
    registry.mark_dead("decode-1", restarting=False)
    assert registry.down_roles(["encoder", "decode"]) == ["encoder", "decode"]  # an encoder never came at all
    assert not registry.reports(registry.workers["decode-1"])  # its last gauges leave /metrics
