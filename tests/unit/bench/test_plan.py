"""`epd bench plan`'s own parts: the ranking of splits, the SLOs from solo latency, the table, bad flags."""
from __future__ import annotations

import argparse

import pytest

from epd import cli
from epd.bench.plan import calibrated, format_plan, predict, sim_config, sim_seeds, solo_slos
from epd.bench.plan_inputs import ServiceTimes, Split, Workload
from epd.bench.plan_sim import SimConfig, simulate_arrivals

# encode-bound on devices of their own: 4 images of 500 ms, a short prefill, cheap decode steps
ENCODE_BOUND = ServiceTimes(encode_ms_per_image=500, prefill_ms_per_token=0.25, decode_step_ms=10)
WORKLOAD = Workload(images_per_request=4, prompt_tokens=200, output_len=16)


def _args(**overrides) -> argparse.Namespace:
    return argparse.Namespace(**{"num_prompts": 20, "seed": 0, "sim_traces": 2, **overrides})


def test_solo_slos_scale_one_aggregated_worker_alone():
    ttft, tpot = solo_slos(ENCODE_BOUND, WORKLOAD, 3.0)
    assert ttft == pytest.approx(3 * (4 * 500 + 200 * 0.25))
    assert tpot == pytest.approx(3 * 10)


def test_calibration_makes_the_simulated_solo_latency_the_served_one():
    # simulated alone: TTFT 4 * 500 + 200 * 0.25 = 2050 ms, TPOT 10 ms; served: 2100 and 12
    times = calibrated(ENCODE_BOUND, WORKLOAD, solo_ttft_ms=2100.0, solo_tpot_ms=12.0)
    assert times.step_overhead_ms == pytest.approx(2.0)  # every engine step, the prefill's too
    assert times.request_overhead_ms == pytest.approx(2100 - (2000 + 2 + 50))
    (alone,) = simulate_arrivals(Split("aggregated", prefill=1), times, WORKLOAD, [0.0])
    assert (alone.ttft_ms, alone.tpot_ms) == (pytest.approx(2100.0), pytest.approx(12.0))
    # a split pays them too: two encoders (1 s of images), the step overhead, the request's delay
    (alone,) = simulate_arrivals(Split("e-pd", 2, 1), times, WORKLOAD, [0.0])
    assert alone.ttft_ms == pytest.approx(48 + 2 * 500 + 2 + 50)
    # served faster than simulated: no negative overheads
    assert calibrated(ENCODE_BOUND, WORKLOAD, 1000.0, 5.0) == ENCODE_BOUND
    # a mix: text-only requests (60 tokens: 2 + 15 ms alone) have their own overhead
    mix = Workload(images_per_request=4, prompt_tokens=200, output_len=16, text_only_ratio=0.5, text_prompt_tokens=60)
    times = calibrated(ENCODE_BOUND, mix, 2100.0, 12.0, text_ttft_ms=30.0)
    assert times.text_request_overhead_ms == pytest.approx(30 - (2 + 15))
    solo = Split("aggregated", prefill=1)
    image, text = simulate_arrivals(solo, times, mix, [0.0, 10_000.0], text_only=[False, True])
    assert (image.ttft_ms, text.ttft_ms) == (pytest.approx(2100.0), pytest.approx(30.0))


def test_the_first_simulated_trace_is_the_real_runs():
    args = _args(sim_traces=3)
    assert sim_seeds(args, 1)[0] == 0 + 7919 * 1  # bench compare's trace_seed
    assert len(set(sim_seeds(args, 1))) == 3


def test_an_encode_bound_workload_ranks_the_split_with_most_encoders_first():
    # By hand (3 workers, devices of their own): two encoders finish a request's images in 1 s,
    # one encoder in 2 s; a pd worker's 50 ms prefill stalls decode steps well within a 100 ms TPOT.
    # 2E1PD passes 0.5/s; 1E2PD and 1E1P1D cannot (one encoder: 0.5/s at 100% busy); 3A encodes
    # inline and stalls its decodes by 2 s (TPOT ~ 140 ms) whenever two requests share a worker,
    # which grows likelier with the rate.
    rows = predict(_args(), ENCODE_BOUND, WORKLOAD, 3, [0.1, 0.6], 4000.0, 100.0, SimConfig())
    assert [r["split"] for r in rows][:2] == ["2E1PD", "3A"]
    by_split = {r["split"]: r for r in rows}
    assert by_split["2E1PD"]["predicted_goodput"] == 0.6
    assert by_split["1E1P1D"]["predicted_goodput"] == by_split["1E2PD"]["predicted_goodput"] == 0.1
    assert by_split["1E1P1D"]["predicted_max_rate"] < 0.5 < by_split["3A"]["predicted_max_rate"]
    assert by_split["3A"]["predicted_max_rate"] < by_split["2E1PD"]["predicted_max_rate"]


def test_the_simulation_takes_the_engine_flags_of_server_args():
    shared = sim_config(_args(server_args="--max-num-seqs 8", device_per_worker=False, cpu_sharing="shared",
                              cpus="0"))
    assert shared.max_local_prefill_tokens == 512 and shared.max_num_batched_tokens == 2048  # serve's defaults
    assert shared.shared_cores and shared.nice["encoder"] > shared.nice["decode"]
    assert (shared.cores, shared.cpu_sharing, shared.threads_per_worker) == (1, "shared", None)
    pinned = sim_config(_args(server_args="--threads-per-worker 2", device_per_worker=False, cpu_sharing="split",
                              cpus="0"))
    assert (pinned.threads_per_worker, pinned.cpu_sharing, pinned.nice) == (2, "split", {})
    off = sim_config(_args(server_args="--max-local-prefill-tokens 0 --max-num-batched-tokens 1024",
                           device_per_worker=True, cpu_sharing="shared", cpus=None))
    assert (off.max_local_prefill_tokens, off.max_num_batched_tokens, off.shared_cores) == (0, 1024, False)


def test_a_mix_reports_the_text_only_requests_p99_ttft():
    # 1E1P1D on devices of their own, at a rate so low that no two requests meet: a text-only
    # request (60 tokens) is prefilled alone on the decode worker in 15 ms
    mix = Workload(images_per_request=4, prompt_tokens=200, output_len=16, text_only_ratio=0.5,
                   text_prompt_tokens=60, input_len=40, image_sizes=((448, 448),))
    rows = predict(_args(), ENCODE_BOUND, mix, 3, [0.001], 4000.0, 100.0, SimConfig())
    by_split = {r["split"]: r for r in rows}
    assert by_split["1E1P1D"]["predicted_text_only_p99_ttft_ms"] == [pytest.approx(60 * 0.25)]
    assert "predicted_text_only_p99_ttft_ms" not in predict(_args(), ENCODE_BOUND, WORKLOAD, 3, [0.001],
                                                            4000.0, 100.0, SimConfig())[0]


def test_table_sets_prediction_beside_measurement():
    summary = {"rates": [0.15, 0.3], "slo_ttft_ms": 5100.0, "slo_tpot_ms": 96.0, "plans": [{"workers": 3, "splits": [
        {"split": "1E1P1D", "predicted_attainment": [1.0, 0.95], "predicted_goodput": 0.3, "predicted_max_rate": 0.41,
         "measured_attainment": [0.9375, 0.75], "measured_goodput": 0.15, "measured_goodput_ci": [0.0, 0.15]},
        {"split": "3A", "predicted_attainment": [0.5, 0.1], "predicted_goodput": 0.0, "predicted_max_rate": 0.05},
    ]}]}
    lines = format_plan(summary).splitlines()
    assert lines[0] == "SLOs: TTFT 5100 ms, TPOT 96.0 ms; attainment predicted / measured at 0.15, 0.3 req/s"
    assert lines[3].split() == ["1E1P1D", "0.3", "0.41", "0.15", "[<0.15,0.15]", "100%/94%", "95%/75%"]
    assert lines[4].split() == ["3A", "<0.15", "0.05", "-", "-", "50%", "10%"]


@pytest.mark.parametrize("flags, message", [
    (["--workers", "three"], "--workers takes worker counts like 3 or 3,4"),
    (["--workers", "0"], "--workers must be >= 1"),
    (["--workers", "3", "--repeat-image-ratio", "0.5"], "requests alike but for --text-only-ratio"),
    (["--workers", "3", "--server-args", "--max-local-prefill-tokens many"],
     "argument --max-local-prefill-tokens: invalid int value: 'many'"),
    (["--workers", "3", "--top", "-1"], "--top must be >= 0"),
    (["--workers", "3", "--slo-ttft-ms", "100"], "give either --slo-ttft-ms and --slo-tpot-ms, or --slo-scale"),
])
def test_bad_flags_get_a_message_naming_them(flags, message, capsys, tmp_path):
    argv = ["bench", "plan", str(tmp_path), "--rates", "0.1", *flags]
    if "--slo-ttft-ms" not in flags:
        argv += ["--slo-scale", "3"]
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err
