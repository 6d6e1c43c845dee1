"""The `epd` command: make-model, chat (and, as they land, serve, worker, bench)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _make_model(args) -> int:
    from epd.make_model import make_model

    out = make_model(args.dir, preset=args.preset, seed=args.seed)
    print(f"wrote {args.preset} checkpoint to {out}")
    return 0


def _chat(args) -> int:
    from encoders.image_io import ImageError, read_image_size
    from epd.llm import LLM
    from engine.sampling_params import SamplingParams

    if not (Path(args.model) / "config.json").exists():
        print(f"epd chat: {args.model} is not a checkpoint directory (no config.json)", file=sys.stderr)
        return 2
    parts = []
    for path in args.image:
        try:
            data = Path(path).read_bytes()
            read_image_size(data)
        except OSError as exc:
            print(f"epd chat: cannot read image {path}: {exc.strerror}", file=sys.stderr)
            return 2
        except ImageError as exc:
            print(f"epd chat: {path} is not a usable image ({exc})", file=sys.stderr)
            return 2
        parts.append({"type": "image_url", "image_url": {"url": Path(path).resolve().as_uri()}})
    parts.append({"type": "text", "text": args.prompt})
    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    out = llm.chat([[{"role": "user", "content": parts}]], params)[0]
    print(out.outputs[0].text)
    return 0


def _bench_offline(args) -> int:
    from bench.offline import main as run

    run(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epd", description="Disaggregated VLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-model", help="write a random-weight Qwen3-VL checkpoint")
    p.add_argument("dir")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small", "qwen3-vl-2b", "qwen3-vl-4b"])
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_make_model)

    p = sub.add_parser("chat", help="one user turn (images first, then the text); prints the completion")
    p.add_argument("model", help="checkpoint directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--image", action="append", default=[], help="image file (repeatable)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.set_defaults(func=_chat)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    from bench.offline import add_arguments as offline_arguments

    p = bench.add_parser("offline", help="engine throughput against transformers (same machine, one run)")
    offline_arguments(p)
    p.set_defaults(func=_bench_offline)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"epd {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
