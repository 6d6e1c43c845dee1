"""The deployment builder and the supervisor interface (issue 30, point 7).

`Deployment.build` makes each worker plane without starting it, and the
orchestrator is wired to its supervisor at construction: which workers the
registry never judges by silence, and whose restarts /metrics shows. (The
supervisors at work: tests/e2e/serve/test_role_down.py, test_chaos.py, and
tests/e2e/cluster/test_multinode.py for Ray.)"""
from __future__ import annotations

import os

import pytest

from epd.config import ServeConfig
from epd.multiprocess_metrics import MULTIPROC_DIR_ENV
from epd.processes.api_servers import LauncherWorkers
from epd.processes.deployment import Deployment, build_api
from epd.processes.local_supervisor import LocalSupervisor
from epd.processes.supervisor import Supervisor
from epd.processes.threads import WAIT_POLICY_ENV
from epd.transport.wire.auth import make_keys


@pytest.fixture
def environ():
    """What Deployment.build writes into this process's environment, undone after the test
    (a metrics dir left set would make every later WorkerMetrics multi-process)."""
    saved = {name: os.environ.get(name) for name in (MULTIPROC_DIR_ENV, WAIT_POLICY_ENV)}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def test_a_local_deployment_is_built_not_started(tiny_model, environ):
    deployment = Deployment.build(ServeConfig(model=tiny_model, mode="e-pd"))
    try:
        supervisor = deployment.supervisor
        assert isinstance(supervisor, LocalSupervisor) and isinstance(supervisor, Supervisor)
        assert deployment.collectors == [f"ipc://{deployment.run_dir}/api.sock"]
        assert sorted(supervisor.launches) == ["encoder-0", "pd-0"]
        assert supervisor.procs == {}  # nothing runs before start()
        assert supervisor.sees_exit("pd-0") and not supervisor.sees_exit("pd@elsewhere:9000")
        assert os.path.isdir(deployment.mm_cache_dir) and deployment.mm_cache_dir.startswith(deployment.run_dir)
        assert MULTIPROC_DIR_ENV not in os.environ  # one API process: its metrics in memory
    finally:
        deployment.close()
    assert not os.path.exists(deployment.run_dir)


def test_external_workers_for_n_api_processes(tiny_model, tmp_path, environ):
    config = ServeConfig(model=tiny_model, mode="e-pd", external_workers=True, api_servers=2, port=18790,
                         worker_port=18795, worker_keys=str(make_keys(tmp_path / "keys")))
    deployment = Deployment.build(config)
    try:
        assert deployment.collectors == ["tcp://127.0.0.1:18795", "tcp://127.0.0.1:18796"]
        assert deployment.supervisor.launches == {}  # each `epd worker` registers itself
        assert not deployment.supervisor.sees_exit("pd@h:1")  # nobody's children: judged by silence
        assert deployment.keys_dir == config.worker_keys
        assert os.environ[MULTIPROC_DIR_ENV] == os.path.join(deployment.run_dir, "metrics")
    finally:
        deployment.close()
    assert not os.path.exists(deployment.run_dir)


def test_the_orchestrator_reads_its_supervisor_from_construction(tiny_model, environ):
    deployment = Deployment.build(ServeConfig(model=tiny_model, mode="aggregated"))
    try:
        supervisor = deployment.supervisor
        orchestrator, app = build_api(deployment.config, deployment.collectors[0], deployment.mm_cache_dir,
                                      supervisor)
        assert app is not None
        assert orchestrator.registry.supervised("aggregated-0")
        assert not orchestrator.registry.supervised("aggregated@h:1")
        supervisor.restarts["aggregated"] = 2  # as _count_restart leaves it after two restarts
        assert 'epd:worker_restarts_total{role="aggregated"} 2.0' in orchestrator.metrics.render().decode()
        # one of N API processes: the launcher's workers' exits arrive at once; it exports no restarts
        orchestrator, _ = build_api(deployment.config, deployment.collectors[0], deployment.mm_cache_dir,
                                    LauncherWorkers(external_workers=False), api_index=0)
        assert orchestrator.registry.supervised("aggregated-0")
        assert "epd:worker_restarts" not in orchestrator.metrics.render().decode()
    finally:
        deployment.close()
