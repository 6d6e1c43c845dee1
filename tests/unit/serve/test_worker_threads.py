"""`epd worker --cpu-sharing split` leaves OpenMP its default wait policy and
`shared` sets PASSIVE, as `epd serve` does (tests/e2e/serve/test_worker_cpu.py
checks the policy and thread count inside a real `epd worker` process)."""
from __future__ import annotations

import os

import pytest

from epd.cli import build_parser, worker_config
from epd.serve.threads import available_cores, share_cores
from epd.transport.auth import make_keys


@pytest.fixture
def keys(tmp_path):
    return str(make_keys(tmp_path / "keys"))


def test_split_leaves_openmp_its_default(tiny_model, keys, monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    config = worker_config(build_parser().parse_args(
        ["worker", tiny_model, "--role", "pd", "--api", "tcp://127.0.0.1:1", "--worker-keys", keys,
         "--cpu-sharing", "split"]))
    assert config.num_worker_threads() == max(1, available_cores() - 1)
    share_cores(config.cpu_sharing)  # what `epd worker` calls before torch loads
    assert "OMP_WAIT_POLICY" not in os.environ  # as `epd serve --cpu-sharing split`
    share_cores("shared")
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    share_cores("shared")
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"  # the operator's choice stands
