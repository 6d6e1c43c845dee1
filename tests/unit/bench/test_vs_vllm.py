"""`python -m bench.dev.vs_vllm`'s pure parts (rows, ratios with ranges, the table) and its EPD
client against the fake OpenAI server; vLLM itself is not started (not in CI: issue 32)."""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

from bench.dev import vs_vllm, vs_vllm_goodput
from bench.dev.overhead import process_cpu_s, tree_cpu_s
from bench.dev.vs_vllm_table import add_value, greedy_lines, markdown_table, new_row, ratio_summary, summarize


def _args(*extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    vs_vllm.add_arguments(p)
    return p.parse_args(["/ckpt", "--vllm-bin", "/venv/bin/vllm", *extra])


def test_ratio_is_of_the_means_and_the_range_spans_the_rounds_ratios():
    r = ratio_summary([60.0, 40.0, 50.0], [100.0, 50.0, 50.0])
    assert r["mean"] == pytest.approx(50.0) and r["base_mean"] == pytest.approx(200 / 3)
    assert r["ratio"] == pytest.approx(0.75)
    assert (r["ratio_min"], r["ratio_max"]) == (pytest.approx(0.6), pytest.approx(1.0))
    assert r["rounds"] == 3


def test_a_round_missing_on_either_side_is_left_out():
    r = ratio_summary([None, 30.0, 20.0], [10.0, None, 10.0])
    assert r["rounds"] == 1 and r["ratio"] == pytest.approx(2.0)
    assert ratio_summary([None], [10.0])["ratio"] is None


def test_table_has_every_server_and_the_direction_of_each_row():
    tok = new_row("text C=8 output tok/s", "output_throughput", True)
    ttft = new_row("1 image(s) @ 0.5 req/s median TTFT ms", "median_ttft_ms", False)
    for base, epd in ((100.0, 120.0), (80.0, 120.0)):
        add_value(tok, "vllm", base)
        add_value(tok, "aggregated", epd)
    add_value(ttft, "vllm", 200.0)
    add_value(ttft, "aggregated", None)  # a failed run
    results = summarize({"base": "vllm", "servers": ["vllm", "aggregated"], "rows": [tok, ttft]})
    lines = markdown_table(results).splitlines()
    assert lines[0] == "| row | vllm | aggregated | aggregated / vllm (range) |"
    assert lines[2] == "| text C=8 output tok/s (higher is better) | 90 | 120 | 1.33 (1.20-1.50) |"
    assert lines[3] == "| 1 image(s) @ 0.5 req/s median TTFT ms (lower is better) | 200 | - | - |"


def test_a_server_is_shown_with_its_mean_where_the_base_has_no_ratio_to_give():
    goodput = new_row("4 images goodput req/s", "goodput_distserve", True)
    add_value(goodput, "vllm", 0.0)  # no tested rate reached
    add_value(goodput, "e-p-d", 0.6)
    results = summarize({"base": "vllm", "servers": ["vllm", "e-p-d"], "rows": [goodput]})
    assert markdown_table(results).splitlines()[2] == "| 4 images goodput req/s (higher is better) | 0 | 0.6 | - |"


def test_greedy_lines_count_identical_texts_per_server():
    texts = {"vllm": ["a", "b", "c"], "aggregated": ["a", "b", "c"], "e-p-d": ["a", "x", "c"]}
    greedy = {"base": "vllm", "texts": texts}
    assert greedy_lines(greedy) == ["greedy text, aggregated vs vllm: 3/3 prompts identical",
                                    "greedy text, e-p-d vs vllm: 2/3 prompts identical"]


def test_workloads_one_text_row_per_stream_count_and_ttft_tpot_rows_sharing_one_run():
    rows = vs_vllm.workloads(_args("--streams", "1,8", "--image-rows", "4@0.25", "--num-prompts", "4"))
    assert [r["name"] for r in rows] == ["text C=1 output tok/s", "text C=1 server CPU ms per output token",
                                         "text C=8 output tok/s", "text C=8 server CPU ms per output token",
                                         "4 image(s) @ 0.25 req/s median TTFT ms",
                                         "4 image(s) @ 0.25 req/s median TPOT ms"]
    assert [r["num_prompts"] for r in rows[:4]] == [4, 4, 8, 8]  # never fewer requests than streams
    assert rows[1]["shares_run_with"] == rows[0]["name"] and not rows[1]["higher"]
    assert rows[4]["shares_run_with"] == rows[5]["shares_run_with"]
    with pytest.raises(ValueError, match="IMAGES@RATE"):
        vs_vllm.parse_image_rows("4")


def test_vllm_is_found_beside_its_python():
    p = argparse.ArgumentParser()
    vs_vllm.add_arguments(p)
    assert vs_vllm.vllm_bin(p.parse_args(["/ckpt", "--vllm-python", "/v/bin/python"])) == "/v/bin/vllm"


def test_epd_client_runs_a_text_row_through_bench_serve(fake_server, tmp_path):
    args = _args("--streams", "2", "--image-rows", "", "--num-prompts", "3", "--input-len", "5",
                 "--output-len", "4")
    args.model_dir = None  # the fake server has no tokenizer: prompts counted in words
    workload = vs_vllm.workloads(args)[0]
    result = vs_vllm.epd_client(args, workload, fake_server.base_url, "fake-model", 7, tmp_path / "r.json")
    assert result["completed"] == 3 and result["output_throughput"] > 0
    assert fake_server.peak_in_flight <= 2
    bodies = [b for b in fake_server.payloads if b["max_tokens"] == 4]
    assert len(bodies) == 3 and (tmp_path / "r.json").exists()


def test_a_mode_may_carry_its_own_flags_and_every_epd_server_gets_vllms_kv_budget():
    args = _args("--server-args", "--max-num-seqs 64", "--vllm-kv-cache-gib", "3",
                 "--modes", "aggregated,aggregated[--threads-per-worker 2]")
    assert vs_vllm.modes(args) == ["aggregated", "aggregated[--threads-per-worker 2]"]
    assert vs_vllm.epd_server_args(args, "aggregated") == ("aggregated", ["--max-num-seqs", "64", "--kv-cache-gb", "3"])
    assert vs_vllm.epd_server_args(args, "aggregated[--threads-per-worker 2]") == (
        "aggregated", ["--max-num-seqs", "64", "--threads-per-worker", "2", "--kv-cache-gb", "3"])
    own_kv = vs_vllm.epd_server_args(args, "e-p-d[--kv-cache-gb 1]")
    assert own_kv == ("e-p-d", ["--max-num-seqs", "64", "--kv-cache-gb", "1"])
    assert vs_vllm._slug("aggregated[--threads-per-worker 2]") == "aggregated_--threads-per-worker_2_"


def test_goodput_rows_sweep_every_server_each_round_with_slos_from_vllms_solo_latency(fake_server, tmp_path):
    args = _args("--rounds", "2", "--goodput-rates", "40,20", "--goodput-images", "4", "--goodput-num-prompts", "3",
                 "--image-size", "16x16", "--input-len", "5", "--output-len", "3", "--slo-scale", "1000",
                 "--slo-probe-requests", "1")
    args.model_dir = None  # the fake server has no tokenizer: prompts counted in words
    servers = {"vllm": fake_server, "vllm-ec": fake_server, "e-p-d": fake_server}
    models = dict.fromkeys(servers, "fake-model")
    rows, kept = vs_vllm_goodput.goodput_rows(args, servers, models, tmp_path, vs_vllm._slug)
    assert [r["name"].split(" (")[0] for r in rows] == ["4 images goodput req/s", "4 images @ 20 req/s SLO attainment",
                                                        "4 images @ 40 req/s SLO attainment"]
    assert "rates 20,40" in rows[0]["name"] and kept["rates"] == [20.0, 40.0]
    # SLOs 1000x a fake request's solo latency: every request meets them, so goodput is the top rate
    assert rows[0]["values"] == {label: [40.0, 40.0] for label in servers}
    assert rows[1]["values"]["e-p-d"] == [1.0, 1.0]
    assert kept["slo_ttft_ms"] > 0 and len(kept["per_server"]["vllm-ec"]) == 2
    contents = [b["messages"][0]["content"] for b in fake_server.payloads]
    four_images = [c for c in contents if isinstance(c, list) and sum(p["type"] == "image_url" for p in c) == 4]
    # per server and round: a 2-request warm-up and 3 requests at each of 2 rates; plus the solo probe
    assert len(four_images) == 3 * 2 * (2 + 3 * 2) + 1
    assert vs_vllm_goodput.against_lines(rows, "vllm-ec") == ["goodput, vllm / vllm-ec (range): 1.00 (1.00-1.00)",
                                                              "goodput, e-p-d / vllm-ec (range): 1.00 (1.00-1.00)"]
    results = summarize({"base": "vllm", "servers": list(servers), "rows": rows})
    assert "| 4 images @ 20 req/s SLO attainment (higher is better) | 1 | 1 | 1.00 (1.00-1.00) |" in \
        markdown_table(results)


def test_goodput_flags_are_checked_before_any_server_starts():
    assert vs_vllm_goodput.rates(_args()) == []  # no rates: no goodput rows
    with pytest.raises(ValueError, match="> 0"):
        vs_vllm_goodput.rates(_args("--goodput-rates", "0.1,0"))
    with pytest.raises(ValueError, match="--slo-tpot-ms"):
        vs_vllm_goodput.rates(_args("--goodput-rates", "0.1", "--slo-ttft-ms", "500"))


def test_vllm_ec_runs_only_the_greedy_and_goodput_rows(fake_server, tmp_path):
    args = _args("--rounds", "1", "--streams", "1", "--image-rows", "", "--num-prompts", "1", "--input-len", "5",
                 "--output-len", "2")
    args.model_dir = None
    fake_server.proc = SimpleNamespace(pid=os.getpid())  # the fake server's process: this one
    servers = {"vllm": fake_server, "vllm-ec": fake_server}
    steal = {}
    rows = vs_vllm.served_rows(args, servers, dict.fromkeys(servers, "fake-model"), tmp_path, steal)
    assert list(rows[0]["values"]) == ["vllm"]
    # the same run's CPU per output token, from /proc: this process served and sent it
    assert rows[1]["name"] == "text C=1 server CPU ms per output token" and rows[1]["values"]["vllm"][0] > 0
    [(run, share)] = steal.items()  # the run's host steal: a share of the vCPUs' time
    assert run.startswith("r0 ") and run.endswith(" vllm") and 0 <= share <= 1


def test_tree_cpu_counts_the_cpu_of_a_grandchild():
    # a child that starts a grandchild burning 0.5 CPU s; the grandchild then waits to be read
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\nprint(1, flush=True)\ntime.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}])"],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert child.stdout.readline().strip() == "1"  # the grandchild burnt its CPU and lives
        assert tree_cpu_s(child.pid) - process_cpu_s(child.pid) >= 0.45  # the grandchild's, not the child's own
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
