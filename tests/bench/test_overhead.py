"""`epd bench overhead`'s pure parts: the profile summary, the workload, CPU readings."""
from __future__ import annotations

import os
import time

import pytest

from epd.bench.light_client import output_tokens
from epd.bench.compare import cpu_set
from epd.bench.overhead import api_pids, process_cpu_s, top_self, workload


def test_top_self_ranks_leaf_frames_by_samples():
    raw = ("main (a.py:1);loop (a.py:2);write (t.py:9) 6\n"
           "main (a.py:1);loop (a.py:2);decode (d.py:3) 3\n"
           "main (a.py:1);write (t.py:9) 1\n")
    assert top_self(raw) == [("write (t.py:9)", 0.7), ("decode (d.py:3)", 0.3)]


def test_workload_is_seeded_and_clear_of_special_tokens():
    a, b = workload(1024, 4, 16, seed=32), workload(1024, 4, 16, seed=32)
    assert a == b and a != workload(1024, 4, 16, seed=128)
    assert all(len(p) == 16 and all(300 <= t < 1024 for t in p) for p in a)


def test_cpu_list_and_process_cpu_time():
    assert cpu_set("0-2,5") == {0, 1, 2, 5}
    assert cpu_set(None) == set(os.sched_getaffinity(0))
    before = process_cpu_s(os.getpid())
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:  # burn 50 ms of CPU
        pass
    assert process_cpu_s(os.getpid()) - before >= 0.03  # clock ticks are 10 ms


def test_output_tokens_reads_the_usage_and_refuses_broken_streams():
    ok = b'data: {"choices":[]}\n\ndata: {"usage":{"prompt_tokens":3,"completion_tokens":7}}\n\ndata: [DONE]\n\n'
    assert output_tokens(200, ok) == 7
    with pytest.raises(ValueError, match="HTTP 503"):
        output_tokens(503, b'{"error": {}}')
    with pytest.raises(ValueError, match="without \\[DONE\\]"):
        output_tokens(200, ok[:-16])
    with pytest.raises(ValueError, match="no usage"):
        output_tokens(200, b"data: {}\n\ndata: [DONE]\n\n")


def test_api_pids_are_the_launcher_or_every_api_process_it_logged():
    assert api_pids(100, "EPD ready (e-p-d); serving 'm' on http://127.0.0.1:1/v1\n") == [100]
    log = ("EPD: API server 0 pid 201\nEPD: API server 1 pid 202\n"
           "EPD: API server 1 exited with code -9; restarting in 0.5 s\nEPD: API server 1 pid 305\n"
           "EPD: API server 1 pid 305 ready; its own socket unix:/tmp/x/http-1.sock\n")
    assert api_pids(100, log) == [201, 305]  # the latest of each index, by index
