"""`--cpu-sharing split` leaves OpenMP its default wait; `shared` makes an
`epd worker`'s threads sleep at once (PASSIVE) and `epd serve`'s spin briefly
(GOMP_SPINCOUNT); an operator's own setting stands (tests/e2e/serve/test_worker_cpu.py
checks the policy and thread count inside a real `epd worker` process)."""
from __future__ import annotations

import os

import pytest

from epd.cli import build_parser, worker_config
from epd.processes.threads import SHORT_SPIN, available_cores, share_cores
from epd.transport.wire.auth import make_keys


@pytest.fixture
def keys(tmp_path):
    return str(make_keys(tmp_path / "keys"))


def test_split_leaves_openmp_its_default(tiny_model, keys, monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    config = worker_config(build_parser().parse_args(
        ["worker", tiny_model, "--role", "pd", "--api", "tcp://127.0.0.1:1", "--worker-keys", keys,
         "--cpu-sharing", "split"]))
    assert config.num_worker_threads() == max(1, available_cores() - 1)
    share_cores(config.cpu_sharing)  # what `epd worker` calls before torch loads
    assert "OMP_WAIT_POLICY" not in os.environ  # as `epd serve --cpu-sharing split`
    assert "GOMP_SPINCOUNT" not in os.environ
    share_cores("shared", external=True)
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in os.environ
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    share_cores("shared", external=True)
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"  # the operator's choice stands


def test_serve_workers_spin_briefly_unless_the_operator_said_otherwise(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    share_cores("shared")  # what `epd serve` calls before it spawns workers
    assert os.environ["GOMP_SPINCOUNT"] == SHORT_SPIN and "OMP_WAIT_POLICY" not in os.environ
    monkeypatch.setenv("GOMP_SPINCOUNT", "500")
    share_cores("shared")
    assert os.environ["GOMP_SPINCOUNT"] == "500"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    share_cores("shared")
    assert "GOMP_SPINCOUNT" not in os.environ
