"""Encoder routing side by side: the same request trace against `epd serve`
under each `--encoder-router`, one policy after the other, on one machine.

    python -m bench.dev.encoder_routing /tmp/small --routers round_robin,cost \
        --encoders 2 --image-size 512x512,128x128,128x128,128x128 --images-per-request 4 ...

The servers start together and are measured one after the other; each gets
the same warm-up (other images) and then the same trace, so no run finds the
trace's images in a cache. Prints P50/P99 TTFT per
router and the ratio against the first. The other flags are
`epd bench serve`'s (dataset, rate, lengths, sizes).
"""
from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

from epd.bench import serve as bench_serve
from epd.bench.compare import cpu_set, _run_at, _Server


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", help="checkpoint directory to serve")
    p.add_argument("--routers", default="round_robin,cost", help="--encoder-router values, in order")
    p.add_argument("--mode", default="e-p-d")
    p.add_argument("--encoders", type=int, default=2)
    p.add_argument("--cpus", default=None, help="CPU list every server is pinned to (default: all)")
    p.add_argument("--cpu-sharing", default="shared")
    p.add_argument("--server-args", default="", help="extra `epd serve` flags")
    p.add_argument("--output-dir", default="bench-results/encoder-routing")
    bench_serve.add_arguments(p)


def main(args) -> dict:
    args.tokenizer = args.tokenizer or args.model_dir
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    routers = [r for r in args.routers.split(",") if r]
    servers, rows = {}, {}
    try:
        # started together (start-up is the slow part), measured one at a time: the idle one polls its sockets
        for router in routers:
            server_args = copy.copy(args)
            server_args.server_args = f"--encoders {args.encoders} --encoder-router {router} {args.server_args}"
            servers[router] = _Server(server_args, args.mode, args.cpu_sharing, cpu_set(args.cpus),
                                      out_dir / f"server-{router}.log")
        for server in servers.values():
            server.wait_ready()
        for router, server in servers.items():
            warmup = copy.copy(args)
            warmup.num_prompts, warmup.seed = 1, args.seed + 1000  # first-use costs out of the trace
            _run_at(warmup, server.base_url, float("inf"), out_dir / f"{router}-warmup.json")
            result = _run_at(args, server.base_url, args.request_rate, out_dir / f"{router}.json")
            rows[router] = {key: result[key] for key in ("completed", "failed", "mean_ttft_ms", "p50_ttft_ms",
                                                         "p99_ttft_ms", "request_throughput") if key in result}
            print(f"{router}: {json.dumps(rows[router])}", flush=True)
        (out_dir / "summary.json").write_text(json.dumps(rows, indent=2))
        print(format_table(rows), flush=True)  # before the servers' (slow) stop
    finally:
        for server in servers.values():
            server.stop()
    return rows


def format_table(rows: dict) -> str:
    base = next(iter(rows.values()))
    lines = ["| router | P50 TTFT (s) | P99 TTFT (s) | P99 vs first |", "|---|---:|---:|---:|"]
    for router, row in rows.items():
        lines.append(f"| {router} | {row['p50_ttft_ms'] / 1e3:.2f} | {row['p99_ttft_ms'] / 1e3:.2f} | "
                     f"{row['p99_ttft_ms'] / base['p99_ttft_ms']:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    main(parser.parse_args())
