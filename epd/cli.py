"""The `epd` command: serve, worker, chat, bench, make-model."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _make_model(args) -> int:
    from epd.tools.make_model import make_model

    out = make_model(args.dir, preset=args.preset, seed=args.seed)
    print(f"wrote {args.preset} checkpoint to {out}")
    return 0


def _chat(args) -> int:
    from epd.encoders.image_io import ImageError, read_image_size
    from epd.llm import LLM
    from epd.transport.sampling import SamplingParams

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
    from epd.bench.offline import main as run

    run(args)
    return 0


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-gb", type=float, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--device", default="auto")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])


def _engine_config(args):
    from epd.engine.config import EngineConfig

    return EngineConfig(num_kv_blocks=args.num_kv_blocks, kv_cache_gb=args.kv_cache_gb,
                        gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                        enable_prefix_caching=args.enable_prefix_caching, dtype=args.dtype, device=args.device,
                        attention_backend=args.attention_backend)


def _limit_images(value: str | None) -> int | None:
    if value is None:
        return None
    key, _, num = value.partition("=")
    if key != "image" or not num.isdigit():
        raise ValueError(f"--limit-mm-per-prompt takes image=N, got {value!r}")
    return int(num)


def _domains(value: str | None) -> tuple[str, ...]:
    """'Host1, host2' -> ("host1", "host2")."""
    return tuple(d.strip().lower() for d in (value or "").split(",") if d.strip())


def serve_config(args):
    """The ServeConfig of parsed `epd serve` arguments (EPD_API_KEY when --api-key is absent)."""
    import os

    from epd.config import MediaConfig, ServeConfig

    return ServeConfig(
        model=args.model, mode=args.mode, num_encoders=args.encoders, num_prefill=args.prefill,
        num_decode=args.decode, host=args.host, port=args.port, mm_cache_dir=args.mm_cache_dir,
        mm_cache_gb=args.mm_cache_gb, router=args.router, served_model_name=args.served_model_name,
        api_key=args.api_key or os.environ.get("EPD_API_KEY") or None, external_workers=args.external_workers,
        worker_port=args.worker_port, threads_per_worker=args.threads_per_worker,
        cpu_sharing=args.cpu_sharing,
        engine=_engine_config(args),
        media=MediaConfig(allowed_local_media_path=args.allowed_local_media_path,
                          allowed_media_domains=_domains(args.allowed_media_domains),
                          max_image_bytes=args.max_image_bytes, max_image_pixels=args.max_image_pixels,
                          media_fetch_timeout_s=args.media_fetch_timeout,
                          limit_images_per_prompt=_limit_images(args.limit_mm_per_prompt)))


def _serve(args) -> int:
    from epd.serve.launcher import serve

    return serve(serve_config(args))


def _worker(args) -> int:
    from epd.serve.launcher import run_external_worker

    if not args.api.startswith("tcp://"):
        raise ValueError(f"--api must be a tcp:// address (the API's worker port), got {args.api!r}")
    if not (Path(args.model) / "config.json").exists():
        raise ValueError(f"{args.model} is not a checkpoint directory (no config.json)")
    return run_external_worker(args.role, args.api, args.model, _engine_config(args), args.host, args.port,
                               args.mm_cache_dir, args.mm_cache_gb, args.max_image_pixels, args.threads)


def _bench_serve(args) -> int:
    from epd.bench.serve import main as run

    run(args)
    return 0


def _bench_compare(args) -> int:
    from epd.bench.compare import main as run

    run(args)
    return 0


def _bench_cache_hit(args) -> int:
    from epd.bench.cache_hit import main as run

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

    p = sub.add_parser("serve", help="start the OpenAI-compatible server and its workers")
    p.add_argument("model", help="checkpoint directory")
    p.add_argument("--mode", default="e-p-d", choices=["aggregated", "e-pd", "e-p-d"])
    p.add_argument("--encoders", type=int, default=1)
    p.add_argument("--prefill", type=int, default=1, help="prefill (or pd / aggregated) workers")
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--mm-cache-dir", default=None, help="embedding cache (LMDB) directory; kept across restarts")
    p.add_argument("--mm-cache-gb", type=float, default=4.0)
    p.add_argument("--router", default="least_loaded", choices=["round_robin", "least_loaded", "prefix_hash"])
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--api-key", default=None, help="require this bearer token (also EPD_API_KEY)")
    p.add_argument("--external-workers", action="store_true",
                   help="start no workers; wait for `epd worker` processes to register")
    p.add_argument("--worker-port", type=int, default=None, help="port workers register on (default: --port + 1)")
    p.add_argument("--threads-per-worker", type=int, default=None)
    p.add_argument("--cpu-sharing", default="shared", choices=["split", "shared"],
                   help="shared (default): every worker may use every core, later stages first (decode, then "
                        "prefill, then encode); split: the cores divided over the workers")
    p.add_argument("--allowed-local-media-path", default=None,
                   help="directory file:// image URLs may read from (default: file:// refused)")
    p.add_argument("--allowed-media-domains", default=None,
                   help="host1,host2: hosts http(s):// image URLs may be fetched from (default: none, refused)")
    p.add_argument("--media-fetch-timeout", type=float, default=5.0,
                   help="seconds one http(s) image fetch may take, redirects included")
    p.add_argument("--max-image-bytes", type=int, default=20 * 1024 * 1024)
    p.add_argument("--max-image-pixels", type=int, default=64_000_000, help="refuse larger images (from the header)")
    p.add_argument("--limit-mm-per-prompt", default=None, help="image=N")
    _add_engine_args(p)
    p.set_defaults(func=_serve)

    p = sub.add_parser("worker", help="one worker on this host, registering with a remote `epd serve`")
    p.add_argument("model", help="checkpoint directory")
    p.add_argument("--role", required=True, choices=["encoder", "prefill", "decode", "pd", "aggregated"])
    p.add_argument("--api", required=True, help="tcp://HOST:PORT of the API's worker port")
    p.add_argument("--host", default="127.0.0.1", help="address to bind this worker's inbox on")
    p.add_argument("--port", type=int, default=0, help="inbox port (0: any free port)")
    p.add_argument("--mm-cache-dir", default=None)
    p.add_argument("--mm-cache-gb", type=float, default=4.0)
    p.add_argument("--max-image-pixels", type=int, default=64_000_000)
    p.add_argument("--threads", type=int, default=None)
    _add_engine_args(p)
    p.set_defaults(func=_worker)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    from epd.bench.offline import add_arguments as offline_arguments

    p = bench.add_parser("offline", help="engine throughput against transformers (same machine, one run)")
    offline_arguments(p)
    p.set_defaults(func=_bench_offline)

    from epd.bench.serve import add_arguments as serve_arguments

    p = bench.add_parser("serve", help="goodput benchmark against a running server (like `vllm bench serve`)")
    serve_arguments(p)
    p.set_defaults(func=_bench_serve)

    from epd.bench.compare import add_arguments as compare_arguments

    p = bench.add_parser("compare", help="aggregated vs e-pd vs e-p-d on one machine, one request trace")
    compare_arguments(p)
    p.set_defaults(func=_bench_compare)

    from epd.bench.cache_hit import add_arguments as cache_hit_arguments

    p = bench.add_parser("cache-hit", help="TTFT of a cached-image request vs a text-only one of equal length")
    cache_hit_arguments(p)
    p.set_defaults(func=_bench_cache_hit)
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
