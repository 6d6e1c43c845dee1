"""The parts `epd serve --api-servers N` adds, without a server: a worker
registering with and reporting to every API process over real ZeroMQ, the
registry taking a re-announced worker, the API's counts as prometheus
counters, addresses and flags. tests/e2e/serve/test_api_servers.py runs it whole."""
from __future__ import annotations

import subprocess
import sys

import pytest

from epd.config import ServeConfig, WorkerConfig
from epd.processes.api_servers import LauncherWorkers
from epd.serve.registry import WorkerRegistry
from epd.serve.worker_metrics import WorkerMetrics
from epd.transport.wire.addresses import MAX_API_SERVERS, Addresses
from epd.transport.wire.auth import WORKER, PlaneKeys, make_keys
from epd.transport.wire.channels import Receiver
from epd.transport.wire.messages import Ready, WorkerStats
from epd.transport.wire.worker_io import REANNOUNCE_S, WorkerIO, WorkerSpec


def stats(worker_id: str = "decode-0", running: int = 3) -> WorkerStats:
    return WorkerStats(worker_id, "decode", running, 0, 10, 16, 0)


def test_a_worker_registers_with_and_reports_to_every_api_process(tmp_path):
    addresses = Addresses.ipc(tmp_path)
    collectors = [Receiver(addresses.collector(k)) for k in range(3)]
    spec = WorkerSpec("decode-0", "decode", addresses.worker("decode", 0), tuple(c.address for c in collectors),
                      None, 0)
    worker = WorkerIO(spec, model_fingerprint="f")
    worker.heartbeat.interval_s = 3600.0  # these tests count messages: no Alive in between (test_heartbeat.py)
    try:
        worker.announce()
        worker.publish(stats())
        for collector in collectors:
            ready = collector.recv(timeout_s=5)
            assert isinstance(ready, Ready) and ready.inbox == spec.inbox
            assert collector.recv(timeout_s=5) == stats()
        worker._announced_s -= REANNOUNCE_S + 1  # a second passed: the next report re-announces
        worker.publish(stats(running=4))
        for collector in collectors:
            assert collector.recv(timeout_s=5) == stats(running=4)
            assert isinstance(collector.recv(timeout_s=5), Ready)
    finally:
        worker.close()
        for collector in collectors:
            collector.close()


def test_one_api_process_hears_ready_again_too(tmp_path):
    """Re-announcing is not only for several API processes: an API that took the
    worker for dead (silent on a slow link, a forged exit) takes it back."""
    addresses = Addresses.ipc(tmp_path)
    collector = Receiver(addresses.collector())
    worker = WorkerIO(WorkerSpec("decode-0", "decode", addresses.worker("decode", 0), (collector.address,), None, 0), "f")
    worker.heartbeat.interval_s = 3600.0
    try:
        worker.announce()
        assert isinstance(collector.recv(timeout_s=5), Ready)
        worker._announced_s -= REANNOUNCE_S + 1
        worker.publish(stats())
        assert collector.recv(timeout_s=5) == stats()
        again = collector.recv(timeout_s=5)
        assert isinstance(again, Ready) and again.session == worker.session != ""
        assert collector.recv(timeout_s=0.2) is None  # once a second, not once a report
    finally:
        worker.close()
        collector.close()


def test_a_reannounced_worker_keeps_its_load_and_a_restarted_one_starts_fresh():
    registry = WorkerRegistry()
    ready = Ready("decode-0", "decode", "ipc:///x/decode-0.sock", "host")
    registry.on_ready(ready)
    registry.on_stats(stats(running=5))
    assert registry.on_ready(ready).load == 5  # the same live worker, again: the router still sees its load
    registry.mark_dead("decode-0")
    info = registry.on_ready(ready)  # its process exited and a new one registered
    assert not info.is_dead and info.stats is None


def test_api_counts_read_like_ints_and_render_as_counters():
    metrics = WorkerMetrics(WorkerRegistry())
    metrics.mm_cache_queries += 2
    metrics.mm_cache_hits += False  # `+= attempt_no == 0` on a retry
    metrics.requests_failed["timeout"] += 1
    metrics.requests_failed["timeout"] += 1
    metrics.requests_refused["busy"] += 1
    text = metrics.render().decode()
    assert "epd:mm_cache_queries_total 2.0" in text
    assert "epd:mm_cache_hits_total 0.0" in text
    assert 'epd:requests_failed_total{reason="timeout"} 2.0' in text
    assert 'epd:requests_refused_total{reason="busy"} 1.0' in text
    assert "epd:worker_restarts" in text
    # several API processes: the launcher exports it, each process reads its supervisor through LauncherWorkers
    metrics = WorkerMetrics(WorkerRegistry(), worker_restarts=LauncherWorkers(external_workers=False).restart_counts)
    assert "epd:worker_restarts" not in metrics.render().decode()


def test_collector_addresses_by_api_index(tmp_path):
    addresses = Addresses.ipc(tmp_path)
    assert addresses.collector() == addresses.collector(0) == f"ipc://{tmp_path}/api.sock"
    assert addresses.collector(3) == f"ipc://{tmp_path}/api-3.sock"


def test_every_api_collector_holds_the_api_key(tmp_path):
    keys = PlaneKeys.load(make_keys(tmp_path / "keys"), WORKER)
    apis = ("tcp://10.0.0.1:9001", "tcp://10.0.0.1:9002")
    assert keys.server_key("tcp://10.0.0.1:9002", apis) == keys.api_public
    assert keys.server_key("tcp://10.0.0.2:27101", apis) == keys.worker_public
    assert keys.server_key("tcp://10.0.0.1:9001", apis[0]) == keys.api_public  # one API process


def test_api_servers_flag_is_checked(tiny_model, tmp_path):
    assert ServeConfig(model=tiny_model, api_servers=2).api_servers == 2
    for bad in (0, MAX_API_SERVERS + 1):
        with pytest.raises(ValueError, match="--api-servers must be in 1..64"):
            ServeConfig(model=tiny_model, api_servers=bad)
    make_keys(tmp_path / "keys")
    worker = WorkerConfig(model=tiny_model, role="decode", api="tcp://h:9001,tcp://h:9002",
                          worker_keys=str(tmp_path / "keys"))
    assert WorkerSpec("w", "decode", "tcp://h:1", tuple(worker.api.split(",")), None, 0).apis == (
        "tcp://h:9001", "tcp://h:9002")
    with pytest.raises(ValueError, match="one per API process"):
        WorkerConfig(model=tiny_model, role="decode", api="tcp://h:9001,ipc:///x", worker_keys=str(tmp_path / "keys"))


def test_the_launcher_imports_no_prometheus_client_before_it_sets_the_metrics_dir():
    """prometheus_client picks in-memory or file-backed values when first imported:
    were `epd serve`'s launcher to import it before PROMETHEUS_MULTIPROC_DIR is
    set, the worker restarts it counts would never reach the API processes."""
    code = ("import sys, epd.cli, epd.processes.launcher, epd.processes.deployment, epd.processes.api_servers; "
            "print('prometheus_client' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
