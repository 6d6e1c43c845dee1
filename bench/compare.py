"""`epd bench compare`: every mode on the same machine and cores, one request trace.

For each mode (default aggregated, e-pd, e-p-d) it starts `epd serve` as a
subprocess pinned to the same CPU set, sends at each rate the identical
request trace (same dataset, seed and arrival times in every mode; a fresh
seed per rate, so no run finds the previous one's images and prefixes in
the caches), and stops the server. Per mode it reports
  (a) goodput — DistServe's: the highest rate at which >= 90% of requests
      meet both the TTFT and the TPOT SLO;
  (b) the published EPD results' rate: the highest rate at which P99 TTFT
      and P99 TPOT both meet their SLOs;
with the ratio to the first mode, a JSON file and a PNG plot. Attainment and
goodput (a) carry a 95% confidence interval (a seeded bootstrap over the
requests, `metrics.attainment_ci` / `distserve_rate_ci`). SLOs are
absolute (`--slo-ttft-ms`, `--slo-tpot-ms`) or relative (`--slo-scale X`:
X times the median solo latency of a few requests, measured on the first
mode with nothing else running).
Like every bench/ module it talks to the server over HTTP only.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from epd.bench import serve as bench_serve
from epd.bench.metrics import (BOOTSTRAP_RESAMPLES, CONFIDENCE, attainment_ci, distserve_max_rate, distserve_rate_ci,
                               p99_max_rate, slo_attainment, tail_latencies_ms)
from epd.bench.report import results_from_json
from epd.config import CPU_SHARING, ServeConfig, field_default
from epd.transport.wire.roles import Mode


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", help="checkpoint directory to serve")
    p.add_argument("--modes", default=",".join(Mode),
                   help="comma-separated MODE[/SHARING] (e.g. e-p-d/shared); the first is the baseline")
    add_sweep_arguments(p)


def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    """Rates, SLOs, cores, server flags and the workload (`bench serve`'s flags): shared with `bench plan`."""
    p.add_argument("--rates", required=True, help="comma-separated request rates (requests/s)")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-scale", type=float, default=None,
                   help="SLOs as multiples of the median solo TTFT/TPOT (measured first, on the first mode)")
    p.add_argument("--slo-probe-requests", type=int, default=4, help="requests run alone to measure solo latency")
    p.add_argument("--cpus", default=None, help="CPU list every server is pinned to, e.g. 0-1 (default: all)")
    p.add_argument("--cpu-sharing", default=field_default(ServeConfig, "cpu_sharing"), choices=list(CPU_SHARING),
                   help="how each server's workers use the CPU set (`epd serve --cpu-sharing`)")
    p.add_argument("--server-args", default="", help="extra `epd serve` flags, e.g. '--max-num-seqs 32'")
    p.add_argument("--output-dir", default="bench-results", help="JSON, per-run results and the PNG go here")
    bench_serve.add_arguments(p)
    p.set_defaults(num_prompts=40, input_len=400, output_len=32, image_size=[(448, 448)], no_progress=True)


def cpu_set(text: str | None) -> set[int]:
    """`--cpus` (e.g. '0-1,4') as a set of CPU numbers; None: those this process may run on."""
    if not text:
        return set(os.sched_getaffinity(0))
    cpus = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def parse_mode(label: str, default_sharing: str) -> tuple[str, str]:
    """'e-p-d/shared' -> ('e-p-d', 'shared'); 'e-pd' -> ('e-pd', default_sharing)."""
    mode, _, sharing = label.partition("/")
    sharing = sharing or default_sharing
    if mode not in set(Mode) or sharing not in CPU_SHARING:
        raise ValueError(f"--modes: {label!r} is not MODE[/SHARING] with MODE one of {', '.join(Mode)} "
                         f"and SHARING one of {', '.join(CPU_SHARING)}")
    return mode, sharing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """One `epd serve` subprocess on a free port, pinned to `cpus`, ready when
    /health is 200 (the server sizes its workers' threads from the CPU set it
    is pinned to). `extra`: more `epd serve` flags. Another server (vs_vllm's
    `vllm serve`) starts through `_launch` with its own command."""

    name = "epd serve"

    def __init__(self, model: str, mode: str, cpus, extra: list[str], log_path: Path,
                 new_session: bool = False):
        self._launch(lambda port: [sys.executable, "-m", "epd.cli", "serve", model, "--mode", mode,
                                   "--port", str(port), *extra], cpus, log_path, new_session=new_session)

    def _launch(self, command, cpus, log_path: Path, env: dict | None = None, new_session: bool = False) -> None:
        """`command(port)`: the argv to run; `env`: the environment (default: this one);
        `new_session`: the server leads its own process group (signalled whole with os.killpg)."""
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.started_s = time.monotonic()
        self.proc = subprocess.Popen(command(self.port), stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=lambda: os.sched_setaffinity(0, cpus), start_new_session=new_session)

    def wait_ready(self, timeout_s: float = 600.0, headers: dict | None = None) -> str:
        """The served model name (`headers`: e.g. the API key's)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} (see {self._log.name})")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return httpx.get(self.base_url + "/v1/models", timeout=5, headers=headers).json()["data"][0]["id"]
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{self.name} not ready after {timeout_s:.0f} s (see {self._log.name})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(2)  # SIGINT: graceful, like Ctrl-C
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class _Server(ServeProcess):
    """The sweeps' server: `args.model_dir` with `--cpu-sharing` and `args.server_args`."""

    def __init__(self, args, mode: str, sharing: str, cpus: set[int], log_path: Path):
        super().__init__(args.model_dir, mode, cpus, ["--cpu-sharing", sharing, *args.server_args.split()], log_path)


def _run_at(args, base_url: str, rate: float, out: Path, seed: int | None = None) -> dict:
    run = copy.copy(args)
    run.base_url, run.request_rate, run.save_result, run.save_detailed = base_url, rate, str(out), True
    if seed is not None:
        run.seed = seed
    return bench_serve.main(run)


def warm_up(args, base_url: str, out: Path) -> None:
    """Two requests of the workload (other images than any trace's): first-use costs
    (allocations, lazy imports) stay out of what is measured next."""
    warmup = copy.copy(args)
    warmup.num_prompts, warmup.seed = 2, args.seed + 1000
    _run_at(warmup, base_url, float("inf"), out)


def trace_seed(args, rate_index: int) -> int:
    """Each rate replays its own trace (same in every mode): a server keeps its
    embedding and prefix caches across rates, so reusing one trace would turn
    every run after the first into cache hits."""
    return args.seed + 7919 * rate_index


def solo_latency_ms(args, base_url: str, out: Path) -> tuple[float, float]:
    """Median TTFT and TPOT (ms) of `--slo-probe-requests` requests sent one at a time."""
    probe = copy.copy(args)
    probe.num_prompts = args.slo_probe_requests
    probe.max_concurrency = 1
    result = _run_at(probe, base_url, float("inf"), out, seed=args.seed + 2000)
    ttfts = [t * 1e3 for t in result["ttfts"] if t]
    tpots = [(e - t) * 1e3 / (n - 1) for e, t, n in zip(result["latencies"], result["ttfts"], result["output_lens"])
             if n and n > 1]
    return statistics.median(ttfts), statistics.median(tpots) if tpots else 0.0


def _solo_slos(args, base_url: str, out_dir: Path) -> tuple[float, float]:
    ttft_ms, tpot_ms = solo_latency_ms(args, base_url, out_dir / "solo.json")
    return args.slo_scale * ttft_ms, args.slo_scale * tpot_ms


def main(args) -> dict:
    args.tokenizer = args.tokenizer or args.model_dir  # prompts of exactly --input-len tokens
    modes = [m for m in args.modes.split(",") if m]
    # parsed up front: a typo fails now, not after the first mode's sweep
    launches = {label: parse_mode(label, args.cpu_sharing) for label in modes}
    rates = sorted(float(r) for r in args.rates.split(","))
    if (args.slo_scale is None) == (args.slo_ttft_ms is None or args.slo_tpot_ms is None):
        raise ValueError("give either --slo-ttft-ms and --slo-tpot-ms, or --slo-scale")
    if args.dataset == "multi-turn":  # its warm-ups and probes are --num-prompts single requests
        raise ValueError("epd bench compare sweeps single requests: run --dataset multi-turn with epd bench serve")
    cpus = cpu_set(args.cpus)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ttft_slo, tpot_slo = args.slo_ttft_ms, args.slo_tpot_ms
    per_mode: dict[str, dict] = {}
    for mode in modes:
        file_label = mode.replace("/", "-")
        server = _Server(args, *launches[mode], cpus, out_dir / f"server-{file_label}.log")
        try:
            server.wait_ready()
            per_mode[mode], ttft_slo, tpot_slo = sweep(args, server.base_url, mode, rates, ttft_slo, tpot_slo, out_dir)
        finally:
            server.stop()
    summary = make_summary(args, modes, rates, cpus, ttft_slo, tpot_slo, per_mode)
    print(format_comparison(summary))
    (out_dir / "compare.json").write_text(json.dumps(summary, indent=2))
    plot(summary, out_dir / "compare.png")
    return summary


def make_summary(args, labels: list[str], rates: list[float], cpus: set[int], ttft_slo: float, tpot_slo: float,
                 per_mode: dict[str, dict]) -> dict:
    """What compare.json holds; `labels` (modes, or placements) in the order swept, the first the base."""
    return {"model_dir": args.model_dir, "modes": labels, "rates": rates, "cpus": sorted(cpus),
            "slo_ttft_ms": ttft_slo, "slo_tpot_ms": tpot_slo, "num_prompts": args.num_prompts,
            "dataset": args.dataset, "input_len": args.input_len, "output_len": args.output_len,
            "images_per_request": args.images_per_request,
            "image_size": [f"{w}x{h}" for w, h in args.image_size],
            "random_mm_bucket_config": None if getattr(args, "random_mm_bucket_config", None) is None
            else {str(key): p for key, p in args.random_mm_bucket_config.items()},
            "repeat_image_ratio": args.repeat_image_ratio, "text_only_ratio": args.text_only_ratio,
            "text_first": args.text_first,
            "ci": {"confidence": CONFIDENCE, "resamples": BOOTSTRAP_RESAMPLES,
                   "method": "percentile bootstrap over requests", "seed": args.seed},
            "per_mode": per_mode}


def sweep(args, base_url: str, label: str, rates: list[float], ttft_slo: float | None, tpot_slo: float | None,
          out_dir: Path) -> tuple[dict, float, float]:
    """One ready server: a warm-up, the solo SLOs if none are set yet (relative
    SLOs come from the first server swept), then every rate's trace. Returns
    (its entry of `per_mode`, the TTFT SLO, the TPOT SLO)."""
    file_label = label.replace("/", "-")
    warm_up(args, base_url, out_dir / f"{file_label}-warmup.json")
    if ttft_slo is None:  # relative SLOs: measured once, on the baseline
        ttft_slo, tpot_slo = _solo_slos(args, base_url, out_dir)
        print(f"SLOs from solo latency x {args.slo_scale}: TTFT {ttft_slo:.0f} ms, TPOT {tpot_slo:.1f} ms")
    runs, rows = [], []
    for i, rate in enumerate(rates):
        result = _run_at(args, base_url, rate, out_dir / f"{file_label}-rate{rate:g}.json", seed=trace_seed(args, i))
        results = results_from_json(result)
        runs.append((rate, results))
        p99_ttft, p99_tpot = tail_latencies_ms(results)
        row = {"rate": rate, "request_throughput": result["request_throughput"],
               "slo_attainment": slo_attainment(results, ttft_slo, tpot_slo),
               "slo_attainment_ci": list(attainment_ci(results, ttft_slo, tpot_slo, seed=args.seed)),
               "p99_ttft_ms": p99_ttft, "p99_tpot_ms": p99_tpot,
               "failed": result["failed"]}
        for key in ("text_only_p99_ttft_ms", "image_p99_ttft_ms"):
            if key in result:
                row[key] = result[key]
        rows.append(row)
        print(f"{label:>10} rate {rate:g}: {json.dumps(row)}", flush=True)
    entry = {"rows": rows, "goodput_distserve": distserve_max_rate(runs, ttft_slo, tpot_slo),
             "goodput_distserve_ci": list(distserve_rate_ci(runs, ttft_slo, tpot_slo, seed=args.seed)),
             "goodput_p99": p99_max_rate(runs, ttft_slo, tpot_slo)}
    return entry, ttft_slo, tpot_slo


def format_comparison(summary: dict) -> str:
    """The side-by-side table. A goodput of 0 means no tested rate passed:
    shown as "<lowest rate", and a ratio against it as a lower bound (">x").
    Below it, each rate's SLO attainment with its confidence interval."""
    modes = summary["modes"]
    lowest = min(summary["rates"])

    def rate(value: float) -> str:
        return f"{value:.3g}" if value else f"<{lowest:g}"

    def ratio(value: float, base: float) -> str:
        if base:
            return f"{value / base:.2f}"
        return f">{value / lowest:.2f}" if value else "-"

    def interval(ci: list[float] | None, show) -> str:
        return f"[{show(ci[0])},{show(ci[1])}]" if ci else "-"

    confidence = summary.get("ci", {}).get("confidence", CONFIDENCE)
    ci_head = f"{confidence:.0%} CI"
    lines = [f"SLOs: TTFT {summary['slo_ttft_ms']:.0f} ms, TPOT {summary['slo_tpot_ms']:.1f} ms",
             f"{'mode':>12} {'goodput(90%)':>13} {ci_head:>15} {'x base':>7} {'P99 rate':>9} {'x base':>7}"]
    base = summary["per_mode"][modes[0]]
    for mode in modes:
        m = summary["per_mode"][mode]
        lines.append(f"{mode:>12} {rate(m['goodput_distserve']):>13} "
                     f"{interval(m.get('goodput_distserve_ci'), rate):>15} "
                     f"{ratio(m['goodput_distserve'], base['goodput_distserve']):>7} "
                     f"{rate(m['goodput_p99']):>9} {ratio(m['goodput_p99'], base['goodput_p99']):>7}")
    if all(summary["per_mode"][mode].get("rows") for mode in modes):
        lines.append(f"SLO attainment, {ci_head} (bootstrap over {summary['num_prompts']} requests a rate):")
        lines.append(f"{'rate':>8} " + " ".join(f"{mode:>18}" for mode in modes))
        for i, r in enumerate(summary["rates"]):
            cells = []
            for mode in modes:
                row = summary["per_mode"][mode]["rows"][i]
                ci = interval(row.get("slo_attainment_ci"), lambda v: f"{v:.0%}")
                cells.append(f"{row['slo_attainment']:.0%} {ci}")
            lines.append(f"{r:>8g} " + " ".join(f"{cell:>18}" for cell in cells))
    return "\n".join(lines)


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [("slo_attainment", "SLO attainment (TTFT and TPOT)", None),
              ("p99_ttft_ms", "P99 TTFT (ms)", summary["slo_ttft_ms"]),
              ("p99_tpot_ms", "P99 TPOT (ms)", summary["slo_tpot_ms"])]
    for ax, (key, title, slo) in zip(axes, panels):
        for mode in summary["modes"]:
            rows = summary["per_mode"][mode]["rows"]
            ax.plot([r["rate"] for r in rows], [r[key] for r in rows], marker="o", label=mode)
        if slo is not None:
            ax.axhline(slo, color="gray", linestyle="--", linewidth=1, label="SLO")
        if key == "slo_attainment":
            ax.axhline(0.9, color="gray", linestyle="--", linewidth=1, label="90%")
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"{summary['images_per_request']} image(s)/request, ~{summary['input_len']} prompt tokens, "
                 f"{summary['output_len']} output tokens, CPUs {summary['cpus']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
