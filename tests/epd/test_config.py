"""How `epd serve` sizes its workers' threads and priorities."""
from __future__ import annotations

import os

import pytest

from epd.config import ServeConfig


def test_split_divides_the_pinned_cores_and_shared_gives_each_worker_all(tiny_model):
    cores = len(os.sched_getaffinity(0))
    split = ServeConfig(model=tiny_model, mode="e-p-d", num_encoders=2, cpu_sharing="split")
    assert split.threads_for_each_worker() == max(1, cores // 4)
    assert {split.worker_nice(role) for role, _ in split.worker_roles()} == {0}
    shared = ServeConfig(model=tiny_model, mode="e-p-d", num_encoders=2)  # the default
    assert shared.threads_for_each_worker() == cores
    nice = {role: shared.worker_nice(role) for role, _ in shared.worker_roles()}
    assert nice["decode"] < nice["prefill"] < nice["encoder"]
    assert ServeConfig(model=tiny_model, mode="aggregated", cpu_sharing="shared").worker_nice("aggregated") == 0
    assert ServeConfig(model=tiny_model, threads_per_worker=3, cpu_sharing="shared").threads_for_each_worker() == 3


def test_bad_sharing_is_refused(tiny_model):
    with pytest.raises(ValueError, match="--cpu-sharing must be one of split, shared"):
        ServeConfig(model=tiny_model, cpu_sharing="spread")
