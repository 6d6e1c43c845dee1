"""`epd bench ...`: each benchmark is a module of epd.bench with `add_arguments(parser)`
and `main(args)`; this table names them, in `epd bench --help`'s order."""
from __future__ import annotations

import importlib

# sub-command -> (module under epd.bench, its one-line help)
BENCHMARKS = {
    "offline": ("offline", "engine throughput against transformers (same machine, one run)"),
    "serve": ("serve", "goodput benchmark against a running server (like `vllm bench serve`)"),
    "compare": ("compare", "aggregated vs e-pd vs e-p-d on one machine, one request trace"),
    "plan": ("plan", "predict the goodput of every E:P:D split of N workers from measured "
                     "service times, then run the best for real"),
    "lora": ("lora", "multi-LoRA: tokens/s and TPOT with 1, 4, 16 adapters mixed vs the base alone; "
                     "an adapter load's cost on the request path"),
    "spec": ("spec_decode", "speculative decoding: decode tokens/s, TPOT and acceptance at 1, 8, 32 streams "
                            "with and without each method (offline engine)"),
    "video-chunks": ("video_chunks", "TTFT of one long video encoded whole vs in chunks over 1, 2 and 4 encoders "
                                     "(--video-chunk-frames)"),
    "cache-hit": ("cache_hit", "TTFT of a cached-image request vs a text-only one of equal length"),
    "overhead": ("overhead", "served vs offline tokens/s on the same requests; API CPU per token"),
    "fault": ("fault", "kill one worker mid-trace: requests completed, recovered, failed, "
                       "time until goodput is back"),
    "body-memory": ("body_memory", "the API process's peak memory and time for request bodies of "
                                   "1, 10, 100 MB"),
    "vs-vllm": ("vs_vllm", "EPD against `vllm serve` (a separate venv: scripts/vllm_env.sh) on one checkpoint "
                           "and one trace, interleaved rounds, each row's ratio with its range"),
    "reliability-probe": ("reliability_probe", "issues 33's and 44's attacks on live servers and a keyed "
                                               "external deployment; the exit code counts the failed checks"),
}


def add_bench_parsers(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    for name, (module_name, text) in BENCHMARKS.items():
        module = importlib.import_module(f"epd.bench.{module_name}")
        p = bench.add_parser(name, help=text)
        module.add_arguments(p)
        p.set_defaults(func=_runner(module))


def _runner(module):
    def run(args) -> int:
        result = module.main(args)
        return result if isinstance(result, int) else 0  # a count of failed checks, where a bench gives one

    return run
