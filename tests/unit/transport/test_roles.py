"""The one definition of worker roles and serving modes."""
from __future__ import annotations

import pytest

from epd.transport.wire.roles import Mode, Role


def test_roles_read_as_their_names():
    assert Role.PREFILL == "prefill" and f"{Role.PD}-3" == "pd-3" and str(Role.ENCODER) == "encoder"
    assert {"decode": 1}[Role.DECODE] == 1 and {Role.DECODE: 1}["decode"] == 1  # wire strings find enum keys
    assert Role.parse("aggregated") is Role.AGGREGATED
    with pytest.raises(ValueError, match="unknown role 'vision'; choose one of encoder, prefill"):
        Role.parse("vision")


def test_what_each_role_does():
    assert [r for r in Role if r.holds_kv] == [Role.PREFILL, Role.DECODE, Role.PD, Role.AGGREGATED]
    assert [r for r in Role if r.takes_prefill] == [Role.PREFILL, Role.PD, Role.AGGREGATED]
    assert [r for r in Role if r.encodes] == [Role.ENCODER, Role.AGGREGATED]
    assert [r.scheduler_role for r in Role if r.holds_kv] == ["prefill", "decode", "pd", "pd"]
    with pytest.raises(ValueError, match="runs no engine"):
        Role.ENCODER.scheduler_role  # noqa: B018


def test_each_mode_starts_its_workers():
    assert Mode.AGGREGATED.roles(3, 2, 5) == [(Role.AGGREGATED, 0), (Role.AGGREGATED, 1)]
    assert Mode.E_PD.roles(1, 2, 5) == [(Role.ENCODER, 0), (Role.PD, 0), (Role.PD, 1)]
    assert Mode.E_P_D.roles(2, 1, 1) == [(Role.ENCODER, 0), (Role.ENCODER, 1), (Role.PREFILL, 0), (Role.DECODE, 0)]
    assert Mode.parse("e-pd") is Mode.E_PD and [str(m) for m in Mode] == ["aggregated", "e-pd", "e-p-d"]
    with pytest.raises(ValueError, match="--mode must be one of aggregated, e-pd, e-p-d, got 'epd'"):
        Mode.parse("epd")


def test_a_worker_spec_holds_a_role():
    from epd.transport.wire.worker_io import WorkerSpec

    spec = WorkerSpec("pd-0", "pd", "ipc:///tmp/x/pd-0.sock", ("ipc:///tmp/x/api.sock",), None, 0)
    assert spec.role is Role.PD and spec.role.holds_kv
    with pytest.raises(ValueError, match="unknown role 'gpu'"):
        WorkerSpec("gpu-0", "gpu", "ipc:///tmp/x/gpu-0.sock", ("ipc:///tmp/x/api.sock",), None, 0)
    with pytest.raises(TypeError, match="tuple of collector addresses"):  # not a comma-joined str
        WorkerSpec("pd-0", "pd", "ipc:///tmp/x/pd-0.sock", "ipc:///tmp/x/api.sock", None, 0)
