"""The `epd` command: make-model, chat, serve, worker, keys, bench.

One module per group of sub-commands, each adding its parsers to `build_parser`:

    model_commands.py   make-model, chat
    serve_command.py    serve (and the ServeConfig its flags make)
    worker_command.py   worker, keys
    bench_commands.py   bench ...
    engine_flags.py     the engine flags serve and worker share
    video_flags.py      the video limit flags serve and worker share
    flags_reference.py  docs/flags.md, written from these parsers (`python -m epd.cli.flags_reference`)

`__main__.py` runs `python -m epd.cli` as the `epd` command.
"""
from __future__ import annotations

import argparse
import sys

from epd.cli.bench_commands import add_bench_parsers
from epd.cli.engine_flags import ENGINE_FLAGS, HelpFormatter, engine_config_of
from epd.cli.model_commands import add_model_parsers
from epd.cli.serve_command import accepted_flag_notes, add_serve_parser, check_checkpoint, ray_config, serve_config
from epd.cli.worker_command import add_worker_parsers, worker_config
from epd.version import __version__

__all__ = ["ENGINE_FLAGS", "HelpFormatter", "accepted_flag_notes", "build_parser", "check_checkpoint",
           "engine_config_of", "main", "ray_config", "serve_config", "worker_config"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epd", description="Disaggregated VLM serving")
    parser.add_argument("--version", action="version", version=f"epd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_model_parsers(sub)
    add_serve_parser(sub)
    add_worker_parsers(sub)
    add_bench_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"epd {args.command}: {exc}", file=sys.stderr)
        return 2
