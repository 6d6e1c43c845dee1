"""`python -m bench.dev.overhead`'s pure parts: the profile summary, the workload, CPU readings."""
from __future__ import annotations

import os
import time

import pytest

from bench.dev.light_client import output_tokens
from bench.dev.overhead import api_pids, format_table, process_cpu_s, summarize, top_self, workload
from epd.bench.compare import cpu_set


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


def test_summary_gives_each_configuration_the_median_of_its_rounds_and_the_ratio_range():
    def row(round_no, ratio, api_us, **extra):
        return {"mode": "e-p-d", "server_args": "", "concurrency": 32, "round": round_no, "offline_tok_s": 1000.0,
                "tok_s": 1000.0 * ratio, "served_over_offline": ratio, "api_us_per_token": api_us,
                "api_cores": 0.2, "workers_cores": 1.0, "client_cores": 0.1, "client_us_per_token": 5.0,
                "steal_cores": 0.0, **extra}

    one = {"mode": "e-p-d", "server_args": "", "concurrency": 32, "round": 0, "one_token": True,
           "offline_req_s": 900.0, "req_s": 450.0, "served_over_offline": 0.5, "api_us_per_request": 700.0,
           "api_cores": 0.4, "workers_cores": 1.0, "client_cores": 0.1, "client_us_per_token": 50.0,
           "steal_cores": 0.01}
    summary = summarize([row(0, 0.5, 30.0), row(1, 0.9, 20.0), one, row(2, 0.8, 25.0)])
    assert [(e["one_token"], e["rounds"]) for e in summary] == [(False, 3), (True, 1)]
    tokens = summary[0]
    assert (tokens["ratio"], tokens["ratio_min"], tokens["ratio_max"]) == (0.8, 0.5, 0.9)
    assert (tokens["api_us"], tokens["served"], tokens["offline"]) == (25.0, 800.0, 1000.0)
    assert (summary[1]["ratio"], summary[1]["api_us"], summary[1]["served"]) == (0.5, 700.0, 450.0)
    table = format_table({"server_args": [""], "cpus": [0, 1], "input_len": 64, "output_len": 128,
                          "offline_threads": 1, "rows": [row(0, 0.5, 30.0), row(1, 0.9, 20.0), one]})
    assert "medians of 2 rounds" in table and "[0.50, 0.90]" in table
