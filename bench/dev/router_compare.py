"""`python -m bench.dev.router_compare MODEL_DIR`: every `--router` side by side on four
engine workers, aggregated x4 and 2 prefill + 2 decode (e-p-d, one encoder), on the
multi-turn workload with images (`epd bench serve --dataset multi-turn`).

    epd make-model /tmp/router-tiny --preset tiny
    python -m bench.dev.router_compare /tmp/router-tiny --num-conversations 8 --num-turns 4

The routers are those of epd/serve/router.py's ROUTERS when this runs (`--routers`
picks some). One server at a time, each fresh (no prefix cache carried over): started,
warmed with single turns of other conversations, then the same workload (same seed,
same conversations); then stopped. Per layout and router: the run's prefix-cache hit
rate, P50/P99 TTFT (all turns, and turns after the first), goodput under `--goodput`,
and each worker's load: the prompt tokens it looked up in its prefix cache (every
prompt token it prefilled or found cached: the workers export no count of requests)
and its mean requests running + waiting, sampled from /metrics every 0.25 s while the
run goes. `max/mean` is the busiest worker's over its role's mean (the goal reads "no
worker above 1.5x the mean"): prompt tokens for aggregated and prefill workers, mean
requests for decode workers. The other flags are `epd bench serve`'s,
with defaults sized for a 2-core machine (a few minutes for both layouts).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import re
import sys
import threading
import time
from pathlib import Path

import httpx

from epd.bench import serve as bench_serve
from epd.bench.compare import ServeProcess, cpu_set
from epd.bench.metrics import percentile
from epd.serve.router import ROUTERS

LAYOUTS = {"aggregated-x4": ("aggregated", ["--prefill", "4"]),
           "2p-2d": ("e-p-d", ["--encoders", "1", "--prefill", "2", "--decode", "2"])}
_SAMPLE = re.compile(r'^(epd:[a-z_]+)\{([^}]*)\} (\S+)$')
_LABEL = re.compile(r'(\w+)="([^"]*)"')
POLL_S = 0.25


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", help="checkpoint directory to serve")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"among {', '.join(LAYOUTS)}")
    p.add_argument("--routers", default=None, help="--router values, in order (default: every one EPD has)")
    p.add_argument("--cpus", default=None, help="CPU list every server is pinned to (default: all)")
    p.add_argument("--server-args", default="--dtype float32 --device cpu --threads-per-worker 1",
                   help="more `epd serve` flags")
    p.add_argument("--output-dir", default="bench-results/router-compare")
    bench_serve.add_arguments(p)
    p.set_defaults(dataset="multi-turn", num_conversations=8, num_turns=4, system_prompt_len=32, input_len=16,
                   output_len=8, images_per_request=1, image_size=[(64, 64)], max_concurrency=4,
                   goodput=["ttft:1000"], no_progress=True)


def worker_values(text: str, metric: str) -> dict[str, float]:
    """`metric` per worker ('role/worker') from Prometheus text."""
    out = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1) == metric:
            labels = dict(_LABEL.findall(match.group(2)))
            if "worker" in labels and labels.get("role") != "encoder":
                out[f"{labels.get('role')}/{labels['worker']}"] = float(match.group(3))
    return out


class LoadPoller:
    """Samples each engine worker's running + waiting requests from /metrics, in a thread."""

    def __init__(self, base_url: str):
        self.url = base_url + "/metrics"
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as http:
            while not self._stop.wait(POLL_S):
                try:
                    text = http.get(self.url).text
                except httpx.HTTPError:
                    continue
                running, waiting = (worker_values(text, f"epd:num_requests_{s}") for s in ("running", "waiting"))
                self.samples.append({w: running[w] + waiting.get(w, 0.0) for w in running})

    def __enter__(self) -> LoadPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def mean_requests(self) -> dict[str, float]:
        workers = sorted({w for s in self.samples for w in s})
        return {w: sum(s.get(w, 0.0) for s in self.samples) / max(1, len(self.samples)) for w in workers}


def prompt_tokens(base_url: str) -> dict[str, float]:
    return worker_values(httpx.get(base_url + "/metrics", timeout=10).text, "epd:prefix_cache_queries_total")


def measure(args, layout: str, router: str, out_dir: Path) -> dict:
    """One fresh server of `layout` under `router`: warm-up, the workload, its row."""
    mode, flags = LAYOUTS[layout]
    server = ServeProcess(args.model_dir, mode, cpu_set(args.cpus),
                          [*flags, "--router", router, *args.server_args.split()], out_dir / f"{layout}-{router}.log")
    try:
        server.wait_ready()
        print(f"{layout} {router}: ready in {time.monotonic() - server.started_s:.0f} s", file=sys.stderr, flush=True)
        warmup = copy.copy(args)  # other conversations (another seed), one turn each: first-use costs out
        warmup.base_url, warmup.seed, warmup.num_turns, warmup.save_result = server.base_url, args.seed + 1000, 1, None
        warmup.num_conversations = 4
        with contextlib.redirect_stdout(io.StringIO()):  # its table is not the result
            bench_serve.main(warmup)
        before = prompt_tokens(server.base_url)
        run = copy.copy(args)
        run.base_url, run.save_result, run.save_detailed = server.base_url, str(out_dir / f"{layout}-{router}.json"), True
        with LoadPoller(server.base_url) as poller:
            result = bench_serve.main(run)
        after = prompt_tokens(server.base_url)  # settled: the run's last read of /metrics waited for it
    finally:
        stop_s = time.monotonic()
        server.stop()
        print(f"{layout} {router}: stopped in {time.monotonic() - stop_s:.0f} s", file=sys.stderr, flush=True)
    return row(result, {w: after[w] - before.get(w, 0.0) for w in after}, poller.mean_requests())


def row(result: dict, tokens: dict[str, float], mean_requests: dict[str, float]) -> dict:
    later = [t for t, turn in zip(result["ttfts"], result["turn_indices"]) if turn > 1 and t]
    by_role: dict[str, list[float]] = {}
    for worker in tokens:  # a decode worker's load is its requests (it prefills only short follow-ups)
        role = worker.split("/")[0]
        by_role.setdefault(role, []).append(mean_requests.get(worker, 0.0) if role == "decode" else tokens[worker])
    imbalance = {role: max(ns) / (sum(ns) / len(ns)) if sum(ns) else None for role, ns in by_role.items()}
    return {"completed": result["completed"], "failed": result["failed"],
            "prefix_cache_hit_rate": result.get("prefix_cache_hit_rate"),
            "p50_ttft_ms": result["p50_ttft_ms"], "p99_ttft_ms": result["p99_ttft_ms"],
            "p50_ttft_later_turns_ms": percentile(later, 50) * 1e3 if later else None,
            "request_goodput": result.get("request_goodput"), "request_throughput": result["request_throughput"],
            "worker_prompt_tokens": tokens, "worker_mean_requests": mean_requests, "max_over_mean": imbalance}


def chosen(text: str | None, names, flag: str) -> list[str]:
    """The comma-separated names of `text` (None: all of `names`, as they are now), each one of `names`."""
    picked = [name for name in (text or ",".join(names)).split(",") if name]
    unknown = [name for name in picked if name not in names]
    if unknown or not picked:
        raise ValueError(f"{flag}: {unknown or text!r} not among {', '.join(names)}")
    return picked


def main(args) -> dict:
    args.tokenizer = args.tokenizer or args.model_dir
    layouts, routers = chosen(args.layouts, LAYOUTS, "--layouts"), chosen(args.routers, ROUTERS, "--routers")
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict] = {}
    for layout in layouts:
        for router in routers:
            rows[f"{layout} {router}"] = measure(args, layout, router, out_dir)
            print(f"{layout} {router}: {json.dumps(rows[f'{layout} {router}'])}", flush=True)
    (out_dir / "summary.json").write_text(json.dumps(rows, indent=2))
    print(format_table(rows), flush=True)
    return rows


def format_table(rows: dict) -> str:
    lines = ["| layout, router | hit rate | P50 TTFT (ms) | P99 TTFT (ms) | P50 TTFT, turns 2+ (ms) | goodput (req/s) "
             "| prompt tokens per worker | max/mean |", "|---|---:|---:|---:|---:|---:|---|---|"]
    for name, r in rows.items():
        rate = "n/a" if r["prefix_cache_hit_rate"] is None else f"{r['prefix_cache_hit_rate']:.0%}"
        later = "n/a" if r["p50_ttft_later_turns_ms"] is None else f"{r['p50_ttft_later_turns_ms']:.0f}"
        goodput = "n/a" if r["request_goodput"] is None else f"{r['request_goodput']:.2f}"
        roles: dict[str, list[str]] = {}
        for worker, n in r["worker_prompt_tokens"].items():
            roles.setdefault(worker.split("/")[0], []).append(f"{n:.0f}")
        tokens = ", ".join(f"{role} {' / '.join(ns)}" for role, ns in roles.items())
        spread = ", ".join(f"{role} {v:.2f}x" for role, v in r["max_over_mean"].items() if v is not None)
        lines.append(f"| {name} | {rate} | {r['p50_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | {later} | {goodput} "
                     f"| {tokens} | {spread} |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    main(parser.parse_args())
