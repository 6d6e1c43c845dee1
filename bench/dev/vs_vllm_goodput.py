"""`python -m bench.dev.vs_vllm`'s goodput rows: K images a request, every server swept over the same rates.

Each round, every server (vLLM aggregated first, then vLLM's encoder
disaggregation if `--vllm-ec`, then each EPD mode) replays the same trace at
each of `--goodput-rates` (`epd bench compare`'s sweep: a warm-up, then one
trace per rate, a fresh one per rate and per round). Goodput is `epd bench
compare`'s (DistServe's): the highest tested rate at which at least 90% of
the requests meet both the TTFT and the TPOT SLO (metrics.distserve_max_rate;
0 when none does). The SLOs are absolute (`--slo-ttft-ms`, `--slo-tpot-ms`)
or `--slo-scale` times vLLM aggregated's median solo TTFT and TPOT, measured
once before the first sweep. The rows go into vs_vllm_table's table like the
others (each server against vLLM aggregated, ratio of the means over rounds
with the per-round range): the goodput, and the SLO attainment at each rate
(which still compares servers when none reaches 90%); `against_lines` adds
each EPD mode's goodput against vLLM's encoder disaggregation.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from bench.dev.vs_vllm_table import add_value, new_row, ratio_summary, ratio_text
from epd.bench import compare
from epd.bench import serve as bench_serve

GOODPUT_METRIC = "goodput_distserve"


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("goodput rows (epd bench compare's goodput, K images a request)")
    g.add_argument("--goodput-rates", default="", help="request rates (req/s), comma-separated; empty: no goodput rows")
    g.add_argument("--goodput-images", type=int, default=4, help="images per request")
    g.add_argument("--goodput-num-prompts", type=int, default=16, help="requests per rate")
    g.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT SLO (with --slo-tpot-ms)")
    g.add_argument("--slo-tpot-ms", type=float, default=None, help="TPOT SLO (with --slo-ttft-ms)")
    g.add_argument("--slo-scale", type=float, default=5.0,
                   help="without absolute SLOs: this times vLLM aggregated's median solo TTFT and TPOT")
    g.add_argument("--slo-probe-requests", type=int, default=3, help="requests sent alone to measure solo latency")


def rates(args) -> list[float]:
    """`--goodput-rates` ascending; a typo raises ValueError before any server starts."""
    values = sorted(float(r) for r in args.goodput_rates.split(",") if r.strip())
    if any(r <= 0 for r in values):
        raise ValueError(f"--goodput-rates must be > 0, got {args.goodput_rates!r}")
    if (args.slo_ttft_ms is None) != (args.slo_tpot_ms is None):
        raise ValueError("give both --slo-ttft-ms and --slo-tpot-ms, or neither (then --slo-scale)")
    return values


def sweep_args(args, seed: int) -> argparse.Namespace:
    """`epd bench compare`'s sweep arguments (bench serve's flags, SLO scale and probe) for this workload."""
    p = argparse.ArgumentParser()
    bench_serve.add_arguments(p)
    run = p.parse_args([*(["--tokenizer", args.model_dir] if args.model_dir else []), "--dataset", "random-mm",
                        "--num-prompts", str(args.goodput_num_prompts),
                        "--images-per-request", str(args.goodput_images), "--image-size", args.image_size,
                        "--text-first", "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                        "--seed", str(seed), "--no-progress"])
    run.slo_scale, run.slo_probe_requests = args.slo_scale, args.slo_probe_requests
    return run


def goodput_rows(args, servers: dict, models: dict, out_dir: Path, slug) -> tuple[list[dict], dict]:
    """Every server swept at every rate, round after round; (the rows, what the JSON keeps:
    rates, SLOs and each server's sweep per round). `slug(label)`: a label as a file name."""
    tested = rates(args)
    if not tested:
        return [], {}
    k = args.goodput_images
    ttft_slo, tpot_slo = args.slo_ttft_ms, args.slo_tpot_ms
    sweeps: dict[str, list[dict | None]] = {label: [] for label in servers}
    for r in range(args.rounds):
        run = sweep_args(args, seed=args.seed + 104729 * (r + 1))  # a fresh trace each round, no other row's
        round_dir = out_dir / f"goodput-r{r}"
        round_dir.mkdir(parents=True, exist_ok=True)
        for label, server in servers.items():
            run.model = models[label]
            try:
                entry, ttft_slo, tpot_slo = compare.sweep(run, server.base_url, slug(label), tested,
                                                          ttft_slo, tpot_slo, round_dir)
            except Exception as exc:  # one failed sweep leaves a gap, not the whole bench
                print(f"round {r} goodput {label}: failed ({exc})", flush=True)
                entry = None
            sweeps[label].append(entry)
            if entry:
                print(f"round {r} goodput {label}: {entry[GOODPUT_METRIC]} req/s", flush=True)
    if ttft_slo is None:  # every server failed before the SLOs were measured
        return [], {"rates": tested, "images": k, "per_server": sweeps}
    listed = ",".join(f"{x:g}" for x in tested)
    goodput = new_row(f"{k} images goodput req/s (>=90% within TTFT {ttft_slo:.0f} ms and TPOT {tpot_slo:.0f} ms; "
                      f"rates {listed})", GOODPUT_METRIC, True)
    attainment = [new_row(f"{k} images @ {x:g} req/s SLO attainment", "slo_attainment", True) for x in tested]
    for label, entries in sweeps.items():
        for entry in entries:
            add_value(goodput, label, entry[GOODPUT_METRIC] if entry else None)
            for i, row in enumerate(attainment):
                add_value(row, label, entry["rows"][i]["slo_attainment"] if entry else None)
    kept = {"rates": tested, "images": k, "slo_ttft_ms": ttft_slo, "slo_tpot_ms": tpot_slo, "per_server": sweeps}
    return [goodput, *attainment], kept


def against_lines(rows: list[dict], base: str) -> list[str]:
    """Each other server's goodput against `base`'s (vLLM's encoder disaggregation), ratio with range."""
    goodput = next((row for row in rows if row["metric"] == GOODPUT_METRIC), None)
    if goodput is None or base not in goodput["values"]:
        return []
    lines = []
    for server, values in goodput["values"].items():
        if server != base:
            summary = ratio_summary(values, goodput["values"][base])
            lines.append(f"goodput, {server} / {base} (range): {ratio_text(summary)}")
    return lines
