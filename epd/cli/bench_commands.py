"""`epd bench ...`: each benchmark is a module of epd.bench with `add_arguments(parser)`
and `main(args)`; this table names them, in `epd bench --help`'s order. These are what a
user runs; the developer experiments are bench/dev/, run from a checkout
(`python -m bench.dev.<name>`)."""
from __future__ import annotations

import importlib

# sub-command -> (module under epd.bench, its one-line help)
BENCHMARKS = {
    "offline": ("offline", "engine throughput against transformers (same machine, one run)"),
    "serve": ("serve", "goodput benchmark against a running server (like `vllm bench serve`)"),
    "compare": ("compare", "aggregated vs e-pd vs e-p-d on one machine, one request trace"),
    "plan": ("plan", "predict the goodput of every E:P:D split of N workers from measured "
                     "service times, then run the best for real"),
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
        module.main(args)  # prints its table; returns its result
        return 0

    return run
