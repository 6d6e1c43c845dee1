"""`epd bench plan`: choose an E:P:D split for the operator's own traffic, then check it.

  1. Measure each stage's service time on the workload (bench/plan_measure.py:
     in-process, pinned to the same cores as the servers will be), then what
     serving adds to it: a few requests sent one at a time to one aggregated
     worker (`calibrate`); unless `--no-calibrate`.
  2. Simulate every split of `--workers N` workers (aggregated, e-pd and
     e-p-d; bench/plan_sim.py) at each of `--rates` on traces like the real
     run's (the real trace's seed plus `--sim-traces - 1` more, averaged),
     and print the predicted SLO attainment and goodput of each. On a CPU
     the workers share the cores (`--cpu-sharing shared`'s niceness per
     role); on GPUs (`--device-per-worker`) each has its own.
  3. Start the best `--top` splits for real (`epd serve`, as `epd bench
     compare` does: same cores, the same trace at each rate) and print
     predicted against measured attainment and goodput.
Goodput is `bench compare`'s (a): the highest tested rate at which >= 90% of
requests meet both the TTFT and TPOT SLOs. With `--slo-scale X` the SLOs
are X times one aggregated worker's simulated solo TTFT and TPOT (of a
request with images, when the workload has any).
The workload is `--dataset random-mm`, optionally with `--text-only-ratio`
(the simulation draws the same text-only requests as the real run); the
engine flags among `--server-args` (`--max-num-batched-tokens`,
`--max-local-prefill-tokens`) reach the simulation too.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

from epd.bench import compare
from epd.bench.metrics import attainment_ci, distserve_max_rate, distserve_rate_ci, percentile, slo_attainment
from epd.bench.plan_inputs import ServiceTimes, Split, splits
from epd.bench.plan_sim import SimConfig, attainment, goodput_of, max_goodput, simulate_arrivals, simulate_traces
from epd.bench.report import results_from_json
from epd.config import SHARED_CPU_NICE


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", help="checkpoint directory to serve")
    p.add_argument("--workers", required=True, help="worker processes in all, e.g. 3, or several: 3,4")
    p.add_argument("--top", type=int, default=2, help="the best N splits are run for real (0: predict only)")
    p.add_argument("--sim-traces", type=int, default=20, help="simulated traces per rate (averaged)")
    p.add_argument("--kv-transfer-ms", type=float, default=0.0,
                   help="time a request's KV takes from prefill to decode worker (not measured in-process)")
    p.add_argument("--device-per-worker", action="store_true",
                   help="simulate a device per worker (GPUs) instead of workers sharing the cores")
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                   help="simulate with the offline service times alone (no served probe of serving overheads)")
    compare.add_sweep_arguments(p)  # the rates, workload, SLO and server flags of `bench compare`


def _worker_counts(text: str) -> list[int]:
    try:
        counts = [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        raise ValueError(f"--workers takes worker counts like 3 or 3,4; got {text!r}") from None
    if not counts or min(counts) < 1:
        raise ValueError(f"--workers must be >= 1, got {text!r}")
    return counts


def sim_seeds(args, rate_index: int) -> list[int]:
    """The real run's trace seed at this rate first, then `--sim-traces - 1` others."""
    first = compare.trace_seed(args, rate_index)
    return [first + 104729 * k for k in range(args.sim_traces)]


def solo_slos(times, workload, scale: float) -> tuple[float, float]:
    """`scale` x one aggregated worker's TTFT and TPOT for a request alone (simulated)."""
    (alone,) = simulate_arrivals(Split("aggregated", prefill=1), times, workload, [0.0])
    return scale * alone.ttft_ms, scale * (alone.tpot_ms or 0.0)


def calibrate(args, times: ServiceTimes, workload, cpus: set[int], out_dir: Path) -> ServiceTimes:
    """`times` with the serving overheads the offline engine does not pay, from
    `--slo-probe-requests` requests (with images, if the workload has any) sent one at a
    time to one aggregated worker (and, for a mix, text-only requests apart): the median
    TPOT over the simulation's is work added to every engine step; the median TTFT over the
    simulation's (with that step overhead) is the simulated API process's work a request."""
    images = copy.copy(args)
    images.text_only_ratio = 0.0  # the simulation's solo request is one with the workload's images
    with _serving(images, Split("aggregated", prefill=1), cpus, out_dir, "calibration") as base_url:
        ttft_ms, tpot_ms = compare.solo_latency_ms(images, base_url, out_dir / "calibration.json")
        text_ttft_ms = None
        if workload.text_only_ratio and workload.images_per_request:  # a mix: text-only requests alone too
            text = copy.copy(args)
            text.text_only_ratio = 1.0
            text_ttft_ms, _ = compare.solo_latency_ms(text, base_url, out_dir / "calibration-text.json")
    return calibrated(times, workload, ttft_ms, tpot_ms, text_ttft_ms)


@contextlib.contextmanager
def _serving(args, split: Split, cpus: set[int], out_dir: Path, name: str) -> Iterator[str]:
    """`split` served for real (`epd serve` with its worker counts, as `bench compare`
    serves a mode), warmed up with `args`' workload; yields its base URL."""
    run = copy.copy(args)
    run.server_args = " ".join(split.worker_args() + args.server_args.split())
    server = compare._Server(run, split.mode, args.cpu_sharing, cpus, out_dir / f"server-{name}.log")
    try:
        server.wait_ready()
        compare.warm_up(args, server.base_url, out_dir / f"{name}-warmup.json")
        yield server.base_url
    finally:
        server.stop()


def calibrated(times: ServiceTimes, workload, solo_ttft_ms: float, solo_tpot_ms: float,
               text_ttft_ms: float | None = None) -> ServiceTimes:
    """`times` with the overheads that make one aggregated worker's simulated solo
    latency the served one (none below the simulation's); with `text_ttft_ms`, a
    text-only request's own request overhead the same way."""
    solo = Split("aggregated", prefill=1)
    (alone,) = simulate_arrivals(solo, times, workload, [0.0])
    stepped = dataclasses.replace(times, step_overhead_ms=max(0.0, solo_tpot_ms - (alone.tpot_ms or 0.0)))
    (alone,) = simulate_arrivals(solo, stepped, workload, [0.0])
    out = dataclasses.replace(stepped, request_overhead_ms=max(0.0, solo_ttft_ms - alone.ttft_ms))
    if text_ttft_ms is None:
        return out
    (alone,) = simulate_arrivals(solo, dataclasses.replace(out, text_request_overhead_ms=0.0), workload, [0.0],
                                 text_only=[True])
    return dataclasses.replace(out, text_request_overhead_ms=max(0.0, text_ttft_ms - alone.ttft_ms))


def sim_config(args) -> SimConfig:
    """How the simulated workers run: the servers' cores shared by niceness, with the threads
    `epd serve` gives each worker (or `--device-per-worker`), and the engine flags of
    `--server-args` the simulation models, with `epd serve`'s defaults."""
    from epd.cli import engine_config_of

    server_args = args.server_args.split()
    scheduler = engine_config_of(server_args).scheduler
    budgets = {"max_num_batched_tokens": scheduler.max_num_batched_tokens,
               "max_local_prefill_tokens": scheduler.max_local_prefill_tokens}
    if args.device_per_worker:
        return SimConfig(**budgets)
    threads = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    threads.add_argument("--threads-per-worker", type=int, default=None)
    nice = {str(role): nice for role, nice in SHARED_CPU_NICE.items()} if args.cpu_sharing == "shared" else {}
    return SimConfig(shared_cores=True, nice=nice, cores=len(compare.cpu_set(args.cpus)),
                     cpu_sharing=args.cpu_sharing,
                     threads_per_worker=threads.parse_known_args(server_args)[0].threads_per_worker, **budgets)


def predict(args, times, workload, num_workers: int, rates: list[float], ttft_slo: float, tpot_slo: float,
            config: SimConfig) -> list[dict]:
    """Every split of `num_workers`, best first: predicted attainment per rate and goodput
    (and, for a workload with text-only requests, their P99 TTFT per rate)."""
    rows = []
    for split in splits(num_workers):
        per_rate, text_only_p99 = {}, []
        for i, rate in enumerate(rates):
            outcomes = simulate_traces(split, times, workload, rate, num_requests=args.num_prompts,
                                       seeds=sim_seeds(args, i), config=config)
            per_rate[rate] = attainment(outcomes, ttft_slo, tpot_slo)
            if workload.text_only_ratio:
                text_only_p99.append(percentile([o.ttft_ms for o in outcomes if o.is_text_only], 99))
        goodput = goodput_of(per_rate)
        finest = max_goodput(split, times, workload, num_requests=args.num_prompts, ttft_slo_ms=ttft_slo,
                             tpot_slo_ms=tpot_slo, seeds=sim_seeds(args, 0)[:5], config=config,
                             high=10 * max(rates), steps=10)
        rows.append({"split": split.label, "mode": split.mode, "encoders": split.encoders,
                     "prefill": split.prefill, "decode": split.decode,
                     "predicted_attainment": [per_rate[r] for r in rates],
                     "predicted_goodput": goodput, "predicted_max_rate": finest})
        if workload.text_only_ratio:
            rows[-1]["predicted_text_only_p99_ttft_ms"] = text_only_p99
    rows.sort(key=lambda r: (r["predicted_goodput"], r["predicted_max_rate"]), reverse=True)
    return rows


def _split_of(row: dict) -> Split:
    return Split(row["mode"], row["encoders"], row["prefill"], row["decode"])


def measure_split(args, split: Split, rates: list[float], ttft_slo: float, tpot_slo: float, cpus: set[int],
                  out_dir: Path) -> dict:
    """Serve `split` for real and send each rate's trace (the same as `bench compare`'s)."""
    sweep, attained, intervals, text_only_p99 = [], [], [], []
    with _serving(args, split, cpus, out_dir, split.label) as base_url:
        for i, rate in enumerate(rates):
            result = compare._run_at(args, base_url, rate, out_dir / f"{split.label}-rate{rate:g}.json",
                                     seed=compare.trace_seed(args, i))
            results = results_from_json(result)
            sweep.append((rate, results))
            attained.append(slo_attainment(results, ttft_slo, tpot_slo))
            intervals.append(list(attainment_ci(results, ttft_slo, tpot_slo, seed=args.seed)))
            text_only_p99.append(result.get("text_only_p99_ttft_ms"))
            text = (f", text-only P99 TTFT {text_only_p99[-1]:.0f} ms" if text_only_p99[-1] is not None else "")
            print(f"{split.label:>8} rate {rate:g}: attainment {attained[-1]:.0%} "
                  f"[{intervals[-1][0]:.0%}, {intervals[-1][1]:.0%}]{text}", flush=True)
    measured = {"measured_text_only_p99_ttft_ms": text_only_p99} if any(p is not None for p in text_only_p99) else {}
    return {**measured, "measured_attainment": attained, "measured_attainment_ci": intervals,
            "measured_goodput": distserve_max_rate(sweep, ttft_slo, tpot_slo),
            "measured_goodput_ci": list(distserve_rate_ci(sweep, ttft_slo, tpot_slo, seed=args.seed))}


def main(args) -> dict:
    from epd.bench.plan_measure import measure

    args.tokenizer = args.tokenizer or args.model_dir
    worker_counts = _worker_counts(args.workers)
    rates = sorted(float(r) for r in args.rates.split(","))
    if (args.slo_scale is None) == (args.slo_ttft_ms is None or args.slo_tpot_ms is None):
        raise ValueError("give either --slo-ttft-ms and --slo-tpot-ms, or --slo-scale")
    if args.dataset != "random-mm" or args.images_range_ratio or args.repeat_image_ratio:
        raise ValueError("the planner simulates requests alike but for --text-only-ratio: use --dataset random-mm "
                         "without --images-range-ratio or --repeat-image-ratio")
    if args.top < 0 or args.sim_traces < 1:
        raise ValueError("--top must be >= 0 and --sim-traces >= 1")
    config = sim_config(args)
    cpus = compare.cpu_set(args.cpus)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    times, workload = measure(args, cpus)
    one = "" if args.device_per_worker else ", one thread"
    print(f"service times (ms, one worker alone on CPUs {sorted(cpus)}{one}): encode {times.encode_ms_per_image:.0f} "
          f"an image, prefill {times.prefill_ms_per_token * workload.prompt_tokens:.0f} for "
          f"{workload.prompt_tokens} tokens, decode step {times.decode_step_ms:.1f} + "
          f"{times.decode_ms_per_seq:.1f} a sequence"
          + (f"; text-only prompts {workload.text_prompt_tokens} tokens" if workload.text_only_ratio else ""),
          flush=True)
    if args.calibrate:
        times = calibrate(args, times, workload, cpus, out_dir)
        text = times.text_request_overhead_ms
        print(f"serving overheads (one aggregated worker, requests alone): {times.step_overhead_ms:.1f} ms an "
              f"engine step, {times.request_overhead_ms:.0f} ms a request"
              + (f" ({text:.0f} ms a text-only one)" if text is not None else ""), flush=True)
    if args.slo_scale is not None:
        ttft_slo, tpot_slo = solo_slos(times, workload, args.slo_scale)
    else:
        ttft_slo, tpot_slo = args.slo_ttft_ms, args.slo_tpot_ms
    plans = []
    for num_workers in worker_counts:
        rows = predict(args, times, workload, num_workers, rates, ttft_slo, tpot_slo, config)
        print("predicted, before any real run:")
        print(format_plan({"rates": rates, "slo_ttft_ms": ttft_slo, "slo_tpot_ms": tpot_slo,
                           "plans": [{"workers": num_workers, "splits": rows}]}), flush=True)
        for row in rows[:args.top]:
            row.update(measure_split(args, _split_of(row), rates, ttft_slo, tpot_slo, cpus, out_dir))
        plans.append({"workers": num_workers, "splits": rows})
    summary = {"model_dir": args.model_dir, "rates": rates, "cpus": sorted(cpus), "slo_ttft_ms": ttft_slo,
               "slo_tpot_ms": tpot_slo, "num_prompts": args.num_prompts, "sim_traces": args.sim_traces,
               "shared_cores": config.shared_cores, "cores": config.cores, "cpu_sharing": config.cpu_sharing,
               "threads_per_worker": config.threads_per_worker, "service_times": times.__dict__,
               "workload": workload.__dict__, "plans": plans}
    print(format_plan(summary))
    (out_dir / "plan.json").write_text(json.dumps(summary, indent=2))
    return summary


def format_plan(summary: dict) -> str:
    """Per worker count: every split's predicted attainment and goodput, best first, with the
    measured ones beside the splits that were run."""
    rates = summary["rates"]
    lowest = min(rates)

    def rate(value: float) -> str:
        return f"{value:.3g}" if value else f"<{lowest:g}"

    lines = [f"SLOs: TTFT {summary['slo_ttft_ms']:.0f} ms, TPOT {summary['slo_tpot_ms']:.1f} ms; attainment "
             f"predicted / measured at " + ", ".join(f"{r:g}" for r in rates) + " req/s"]
    for plan in summary["plans"]:
        lines.append(f"{plan['workers']} workers:")
        lines.append(f"{'split':>8} {'predicted':>10} {'max rate':>9} {'measured':>10} {'95% CI':>15}  attainment")
        for row in plan["splits"]:
            measured = "measured_goodput" in row
            cells = []
            for i, predicted in enumerate(row["predicted_attainment"]):
                cells.append(f"{predicted:.0%}" + (f"/{row['measured_attainment'][i]:.0%}" if measured else ""))
            ci = row.get("measured_goodput_ci")
            lines.append(f"{row['split']:>8} {rate(row['predicted_goodput']):>10} {row['predicted_max_rate']:>9.3g} "
                         f"{rate(row['measured_goodput']) if measured else '-':>10} "
                         f"{f'[{rate(ci[0])},{rate(ci[1])}]' if ci else '-':>15}  {' '.join(cells)}")
    return "\n".join(lines)
