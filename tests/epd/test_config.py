"""How `epd serve` sizes its workers: threads, priorities, GPUs and their memory."""
from __future__ import annotations

import os

import pytest

from epd.engine.config import EngineConfig
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


def _placement(config: ServeConfig, num_gpus: int) -> list[tuple[str, str, float]]:
    return [(f"{role}-{i}", e.device, round(e.gpu_memory_utilization, 3))
            for (role, i), e in zip(config.worker_roles(), config.worker_engines(num_gpus))]


def test_workers_on_one_gpu_split_its_memory(tiny_model):
    config = ServeConfig(model=tiny_model, mode="e-p-d", engine=EngineConfig(gpu_memory_utilization=0.9))
    assert _placement(config, 1) == [("encoder-0", "cuda:0", 0.9), ("prefill-0", "cuda:0", 0.45),
                                     ("decode-0", "cuda:0", 0.45)]
    aggregated = ServeConfig(model=tiny_model, mode="aggregated", num_prefill=2)
    assert _placement(aggregated, 1) == [("aggregated-0", "cuda:0", 0.45), ("aggregated-1", "cuda:0", 0.45)]


def test_workers_spread_over_gpus_kv_workers_first(tiny_model):
    config = ServeConfig(model=tiny_model, mode="e-p-d")
    assert _placement(config, 2) == [("encoder-0", "cuda:0", 0.9), ("prefill-0", "cuda:0", 0.9),
                                     ("decode-0", "cuda:1", 0.9)]
    assert [d for _, d, _ in _placement(config, 3)] == ["cuda:2", "cuda:0", "cuda:1"]
    e_pd = ServeConfig(model=tiny_model, mode="e-pd", num_prefill=3)
    assert _placement(e_pd, 2) == [("encoder-0", "cuda:1", 0.9), ("pd-0", "cuda:0", 0.45),
                                   ("pd-1", "cuda:1", 0.9), ("pd-2", "cuda:0", 0.45)]


def test_cpu_or_a_pinned_gpu_keeps_the_placement(tiny_model):
    on_cpu = ServeConfig(model=tiny_model, mode="e-p-d", engine=EngineConfig(device="cpu"))
    assert on_cpu.worker_engines(4) == [on_cpu.engine] * 3
    auto_without_gpu = ServeConfig(model=tiny_model, mode="e-p-d")
    assert auto_without_gpu.worker_engines(0) == [auto_without_gpu.engine] * 3
    pinned = ServeConfig(model=tiny_model, mode="e-p-d", engine=EngineConfig(device="cuda:3"))
    assert _placement(pinned, 8) == [("encoder-0", "cuda:3", 0.9), ("prefill-0", "cuda:3", 0.45),
                                     ("decode-0", "cuda:3", 0.45)]
