"""The `epd` command: serve, worker, chat, bench, make-model."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from epd.config import (CPU_SHARING, TOOL_CALL_PARSERS, UVICORN_LOG_LEVELS, ServeConfig, ServingLimits, WorkerConfig,
                        field_default)
from epd.engine.config import DTYPES, VLLM_DTYPES, EngineConfig
from epd.engine.scheduler_config import PREFILL_PRIORITIES
from epd.flag_values import json_object, limit_mm_per_prompt, string_list
from epd.inputs.media import MediaConfig
from epd.inputs.model_files import ModelFilesConfig
from epd.serve.autoscale import EncoderScaling
from epd.serve.ray_config import ROLE_FLAGS, RayConfig, parse_resources
from epd.serve.encoder_router import ENCODER_ROUTERS
from epd.serve.router import ROUTERS
from epd.transport.roles import Mode, Role
from epd.version import __version__

# flag (without --) -> the engine setting it fills (EngineConfig.from_flat)
ENGINE_FLAGS = ("num_kv_blocks", "kv_cache_gb", "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens",
                "max_model_len", "enable_prefix_caching", "dtype", "device", "attention_backend",
                "early_prefill", "prefill_priority", "max_local_prefill_tokens", "block_size", "seed")


def _make_model(args) -> int:
    from epd.tools.make_model import make_model

    out = make_model(args.dir, preset=args.preset, seed=args.seed)
    print(f"wrote {args.preset} checkpoint to {out}")
    return 0


def _chat(args) -> int:
    from epd.encoders.image_io import ImageError, read_image_size
    from epd.llm import LLM
    from epd.transport.sampling import SamplingParams

    from epd.inputs.model_files import NO_IMAGE_PROCESSOR, PROCESSOR_CONFIG

    if not (Path(args.model) / "config.json").exists():
        print(f"epd chat: {args.model} is not a checkpoint directory (no config.json)", file=sys.stderr)
        return 2
    if args.image and not (Path(args.model) / PROCESSOR_CONFIG).is_file():
        print(f"epd chat: {NO_IMAGE_PROCESSOR}", file=sys.stderr)
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
    llm = LLM(args.model, EngineConfig(dtype=args.dtype, device=args.device), chat_template=args.chat_template)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    out = llm.chat([[{"role": "user", "content": parts}]], params)[0]
    print(out.outputs[0].text)
    return 0


def _bench_offline(args) -> int:
    from epd.bench.offline import main as run

    run(args)
    return 0


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default after its help, unless the help already says it."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        return text if "default" in text else super()._get_help_string(action)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    defaults = EngineConfig.flat_defaults()
    g = p.add_argument_group("engine")
    g.add_argument("--num-kv-blocks", type=int, default=defaults["num_kv_blocks"],
                   help="KV cache blocks of each engine worker (None: from --kv-cache-gb or the GPU's free memory)")
    g.add_argument("--kv-cache-gb", type=float, default=defaults["kv_cache_gb"],
                   help="GiB of KV cache per engine worker (None: 1 on CPU, --gpu-memory-utilization on GPU)")
    g.add_argument("--gpu-memory-utilization", type=float, default=defaults["gpu_memory_utilization"],
                   help="share of each GPU's memory the server may take (split among the KV workers on it)")
    g.add_argument("--max-num-seqs", type=int, default=defaults["max_num_seqs"],
                   help="sequences one engine step may hold")
    g.add_argument("--max-num-batched-tokens", type=int, default=defaults["max_num_batched_tokens"],
                   help="tokens one engine step may compute (longer prompts are prefilled in chunks)")
    g.add_argument("--max-model-len", type=int, default=defaults["max_model_len"],
                   help="prompt + output tokens of one request (None: the model's max_position_embeddings; "
                        "more is refused)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=defaults["enable_prefix_caching"],
                   help="reuse the KV blocks of a prompt prefix already computed (images included, by mm_hash)")
    g.add_argument("--block-size", type=int, default=defaults["block_size"], help="tokens in one KV cache block")
    g.add_argument("--dtype", default=defaults["dtype"], choices=[*DTYPES, *VLLM_DTYPES],
                   help="weights and activations: auto (the checkpoint's own dtype), float32, float16, bfloat16; "
                        "vLLM's half (float16) and float (float32) too")
    g.add_argument("--seed", type=int, default=defaults["seed"],
                   help="torch seed of every engine worker, as vLLM's: requests with no seed sample from it "
                        "(a request's own seed gives the same tokens whatever else runs)")
    g.add_argument("--device", default=defaults["device"], help="auto, cpu, cuda or cuda:N")
    g.add_argument("--attention-backend", default=defaults["attention_backend"], choices=["auto", "torch", "triton"],
                   help="paged attention kernels (auto: torch on CPU, triton on GPU)")
    g.add_argument("--early-prefill", action=argparse.BooleanOptionalAction, default=defaults["early_prefill"],
                   help="prefill a request up to its first image not yet encoded")
    g.add_argument("--prefill-priority", default=defaults["prefill_priority"], choices=list(PREFILL_PRIORITIES),
                   help="which prefill gets the token budget: fcfs, or cost (fewest tokens first, aged)")
    g.add_argument("--max-local-prefill-tokens", type=int, default=defaults["max_local_prefill_tokens"],
                   help="e-p-d: text-only prompts of at most this many tokens are prefilled on a decode worker "
                        "(no KV transfer), which computes at most this many prompt tokens a step; 0: off")


def _engine_config(args) -> EngineConfig:
    return EngineConfig.from_flat(**{name: getattr(args, name) for name in ENGINE_FLAGS})


def engine_config_of(argv: list[str]) -> EngineConfig:
    """The engine settings among `epd serve` flags, with serve's defaults; other flags are ignored.
    A bad value raises ValueError (the planner reads `--server-args` with it)."""
    p = argparse.ArgumentParser(prog="epd serve", add_help=False, allow_abbrev=False, exit_on_error=False)
    _add_engine_args(p)
    try:
        known, _ = p.parse_known_args(argv)
    except argparse.ArgumentError as exc:
        raise ValueError(str(exc)) from None
    return _engine_config(known)


def _domains(value: str | None) -> tuple[str, ...]:
    """'Host1, host2' -> ("host1", "host2")."""
    return tuple(d.strip().lower() for d in (value or "").split(",") if d.strip())


def serve_config(args) -> ServeConfig:
    """The ServeConfig of parsed `epd serve` arguments (EPD_API_KEY when --api-key is absent)."""
    import os

    min_encoders, max_encoders = EncoderScaling.parse_range(args.encoders)
    scaling = None if min_encoders == max_encoders else EncoderScaling(
        min_encoders, max_encoders, scale_up_queue_s=args.encoder_scale_up_queue_s,
        scale_up_window_s=args.encoder_scale_up_window_s, idle_s=args.encoder_idle_s,
        cooldown_s=args.encoder_scale_cooldown_s)
    limits = limit_mm_per_prompt(args.limit_mm_per_prompt)
    cors = {name: field_default(ServeConfig, name) for name in ("allowed_origins", "allowed_methods", "allowed_headers")}
    return ServeConfig(
        max_logprobs=args.max_logprobs, trust_remote_code=args.trust_remote_code,
        enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
        enable_chunked_prefill=args.enable_chunked_prefill, enable_log_requests=args.enable_log_requests,
        disable_log_stats=args.disable_log_stats, uvicorn_log_level=args.uvicorn_log_level,
        allowed_origins=string_list("--allowed-origins", args.allowed_origins, cors["allowed_origins"]),
        allowed_methods=string_list("--allowed-methods", args.allowed_methods, cors["allowed_methods"]),
        allowed_headers=string_list("--allowed-headers", args.allowed_headers, cors["allowed_headers"]),
        allow_credentials=args.allow_credentials,
        model=args.model, mode=args.mode, num_encoders=min_encoders, encoder_scaling=scaling,
        num_prefill=args.prefill,
        num_decode=args.decode, host=args.host, port=args.port, mm_cache_dir=args.mm_cache_dir,
        mm_cache_gb=args.mm_cache_gb, router=args.router, encoder_router=args.encoder_router,
        served_model_name=args.served_model_name,
        api_key=args.api_key or os.environ.get("EPD_API_KEY") or None, metrics_require_key=args.metrics_require_key,
        external_workers=args.external_workers,
        worker_port=args.worker_port, threads_per_worker=args.threads_per_worker,
        cpu_sharing=args.cpu_sharing, worker_keys=args.worker_keys, ray=ray_config(args),
        api_servers=args.api_servers, stream_interval=args.stream_interval,
        engine=_engine_config(args),
        media=MediaConfig(allowed_local_media_path=args.allowed_local_media_path,
                          allowed_media_domains=_domains(args.allowed_media_domains),
                          max_image_bytes=args.max_image_bytes, max_image_pixels=args.max_image_pixels,
                          fetch_timeout_s=args.media_fetch_timeout,
                          limit_images_per_prompt=limits["image"], limit_videos_per_prompt=limits["video"],
                          max_request_pixels=args.max_request_pixels),
        files=ModelFilesConfig(chat_template=args.chat_template, generation_config=args.generation_config,
                               override_generation_config=tuple(
                                   json_object("--override-generation-config",
                                               args.override_generation_config).items()),
                               tokenizer=args.tokenizer, mm_processor_kwargs=tuple(
                                   json_object("--mm-processor-kwargs", args.mm_processor_kwargs).items())),
        limits=ServingLimits(request_timeout_s=args.request_timeout, shutdown_grace_s=args.shutdown_grace,
                             max_pending_requests=args.max_pending_requests,
                             max_pending_image_bytes=int(args.max_pending_image_mb * (1 << 20)),
                             max_request_body_bytes=int(args.max_request_body_mb * (1 << 20)),
                             max_restarts=args.max_restarts, down_retry_s=args.down_retry_interval))


def ray_config(args) -> RayConfig | None:
    """`--cluster ray` and its flags (epd/serve/ray_config.py); None for the local launcher."""
    given = {role: getattr(args, flag[2:].replace("-", "_")) for role, flag in ROLE_FLAGS.items()}
    if args.cluster != "ray":
        used = [ROLE_FLAGS[role] for role, text in given.items() if text is not None]
        if args.ray_address:
            used.append("--ray-address")
        if used:
            raise ValueError(f"{', '.join(used)} need --cluster ray")
        return None
    return RayConfig(address=args.ray_address, **{
        f"{role}_resources": parse_resources(ROLE_FLAGS[role], text)
        for role, text in given.items() if text is not None})


def _serve(args) -> int:
    from epd.serve.launcher import serve

    config = serve_config(args)
    check_checkpoint(config)
    return serve(config)


def check_checkpoint(config: ServeConfig) -> None:
    """Refuses (ValueError, one line) a checkpoint this deployment cannot serve, before
    any process starts; prints what the files say (warnings, sampling defaults)."""
    from epd.inputs.model_files import ModelFiles

    files = ModelFiles.open(config.model, config.files)
    config.engine.resolved_max_model_len(files.max_position_embeddings)
    for note in files.notes() + accepted_flag_notes(config):
        print(f"EPD: {note}", file=sys.stderr, flush=True)


def accepted_flag_notes(config: ServeConfig) -> list[str]:
    """One line for each vLLM flag given that is accepted but does what EPD always does."""
    notes = []
    if config.trust_remote_code:
        notes.append("--trust-remote-code: accepted; EPD never runs code from a checkpoint "
                     "(its own model code and transformers' config, tokenizer and image processor)")
    if config.enable_auto_tool_choice:
        notes.append(f"--enable-auto-tool-choice --tool-call-parser {config.tool_call_parser}: tool_choice "
                     "\"auto\" is always served, parsing hermes <tool_call> blocks")
    if config.enable_chunked_prefill:
        notes.append("--enable-chunked-prefill: accepted; EPD always prefills in chunks of at most "
                     f"--max-num-batched-tokens ({config.engine.scheduler.max_num_batched_tokens}) a step")
    if config.disable_log_stats:
        notes.append("--disable-log-stats: accepted; EPD logs no periodic stats (/metrics has them)")
    return notes


def worker_config(args) -> WorkerConfig:
    """The WorkerConfig of parsed `epd worker` arguments."""
    return WorkerConfig(model=args.model, role=args.role, api=args.api, host=args.host, port=args.port,
                        mm_cache_dir=args.mm_cache_dir, mm_cache_gb=args.mm_cache_gb,
                        max_image_pixels=args.max_image_pixels, max_image_bytes=args.max_image_bytes,
                        num_threads=args.threads,
                        cpu_sharing=args.cpu_sharing, worker_keys=args.worker_keys, engine=_engine_config(args))


def _keys(args) -> int:
    from epd.transport.auth import PlaneKeyError, make_keys

    try:
        directory = make_keys(args.dir)
    except PlaneKeyError as exc:
        print(f"epd keys: {exc}", file=sys.stderr)
        return 2
    print(f"worker-plane keys in {directory}:\n"
          f"  API host:     api.key_secret, api.key, worker.key   (epd serve ... --worker-keys DIR)\n"
          f"  worker hosts: worker.key_secret, worker.key, api.key (epd worker ... --worker-keys DIR)")
    return 0


def _worker(args) -> int:
    from epd.serve.threads import share_cores

    config = worker_config(args)
    share_cores(config.cpu_sharing)  # before the launcher's import loads torch (and libgomp reads it)
    from epd.inputs.model_files import ModelFiles
    from epd.serve.launcher import run_external_worker

    files = ModelFiles.open(config.model)  # a bad checkpoint: one line, exit 2, before any socket is bound
    config.engine.resolved_max_model_len(files.max_position_embeddings)
    return run_external_worker(config)


def _bench_serve(args) -> int:
    from epd.bench.serve import main as run

    run(args)
    return 0


def _bench_compare(args) -> int:
    from epd.bench.compare import main as run

    run(args)
    return 0


def _bench_plan(args) -> int:
    from epd.bench.plan import main as run

    run(args)
    return 0


def _bench_fault(args) -> int:
    from epd.bench.fault import main as run

    run(args)
    return 0


def _bench_body_memory(args) -> int:
    from epd.bench.body_memory import main as run

    run(args)
    return 0


def _bench_overhead(args) -> int:
    from epd.bench.overhead import main as run

    run(args)
    return 0


def _bench_cache_hit(args) -> int:
    from epd.bench.cache_hit import main as run

    run(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epd", description="Disaggregated VLM serving")
    parser.add_argument("--version", action="version", version=f"epd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    from epd.tools.make_model import PRESETS

    p = sub.add_parser("make-model", help="write a random-weight checkpoint (Qwen3-VL, Qwen3-VL-MoE, Qwen2.5-VL)")
    p.add_argument("dir")
    p.add_argument("--preset", default="tiny", choices=list(PRESETS))
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_make_model)

    p = sub.add_parser("chat", help="one user turn (images first, then the text); prints the completion")
    p.add_argument("model", help="checkpoint directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--image", action="append", default=[], help="image file (repeatable)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default=field_default(EngineConfig, "dtype"))
    p.add_argument("--device", default=field_default(EngineConfig, "device"))
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEXT",
                   help="the chat template: a file, or the template itself (default: the checkpoint's)")
    p.set_defaults(func=_chat)

    serve = {name: field_default(ServeConfig, name) for name in (
        "mode", "num_encoders", "num_prefill", "num_decode", "host", "port", "mm_cache_dir", "mm_cache_gb", "router",
        "encoder_router", "served_model_name", "api_key", "metrics_require_key", "worker_port", "threads_per_worker", "cpu_sharing",
        "api_servers", "stream_interval", "max_logprobs", "uvicorn_log_level")}
    media = {name: field_default(MediaConfig, name) for name in (
        "allowed_local_media_path", "fetch_timeout_s", "max_image_bytes", "max_image_pixels")}
    p = sub.add_parser("serve", help="start the OpenAI-compatible server and its workers",
                       formatter_class=HelpFormatter)
    p.add_argument("model", help="checkpoint directory")
    p.add_argument("--mode", default=str(serve["mode"]), choices=[str(m) for m in Mode],
                   help="e-p-d: encoder, prefill and decode workers; e-pd: encoders and prefill+decode workers; "
                        "aggregated: workers that do all three")
    p.add_argument("--encoders", default=str(serve["num_encoders"]), metavar="N|MIN-MAX",
                   help="encoder workers: N, or MIN-MAX to start MIN and scale on load (see --encoder-*)")
    scaling = {name: field_default(EncoderScaling, name) for name in (
        "scale_up_queue_s", "scale_up_window_s", "idle_s", "cooldown_s")}
    p.add_argument("--encoder-scale-up-queue-s", type=float, default=scaling["scale_up_queue_s"],
                   help="MIN-MAX: add an encoder when every encoder's oldest queued image waited this long...")
    p.add_argument("--encoder-scale-up-window-s", type=float, default=scaling["scale_up_window_s"],
                   help="...at every look for this many seconds")
    p.add_argument("--encoder-idle-s", type=float, default=scaling["idle_s"],
                   help="MIN-MAX: remove an encoder (down to MIN) that had nothing to do this long")
    p.add_argument("--encoder-scale-cooldown-s", type=float, default=scaling["cooldown_s"],
                   help="MIN-MAX: seconds after one scaling decision before the next")
    p.add_argument("--prefill", type=int, default=serve["num_prefill"], help="prefill (or pd / aggregated) workers")
    p.add_argument("--decode", type=int, default=serve["num_decode"], help="decode workers (e-p-d)")
    p.add_argument("--host", default=serve["host"], help="address the HTTP server binds")
    p.add_argument("--port", type=int, default=serve["port"], help="HTTP port")
    p.add_argument("--mm-cache-dir", default=serve["mm_cache_dir"],
                   help="embedding cache (LMDB) directory; kept across restarts")
    p.add_argument("--mm-cache-gb", type=float, default=serve["mm_cache_gb"],
                   help="GiB the embedding cache may hold (least recently used out first)")
    p.add_argument("--router", default=serve["router"], choices=list(ROUTERS),
                   help="how a request picks its prefill and decode workers")
    p.add_argument("--encoder-router", default=serve["encoder_router"], choices=list(ENCODER_ROUTERS),
                   help="cost: each image to the encoder where it finishes first; round_robin: in turn")
    p.add_argument("--served-model-name", default=serve["served_model_name"],
                   help="the model's name in the API (None: the checkpoint path as given)")
    p.add_argument("--api-key", default=serve["api_key"], help="require this bearer token (also EPD_API_KEY) on "
                   "/v1/* and the /docs, /redoc and /openapi.json pages")
    p.add_argument("--metrics-require-key", action="store_true", default=serve["metrics_require_key"],
                   help="/metrics needs the API key too (default: open, as in vLLM, for Prometheus)")
    p.add_argument("--api-servers", "--api-server-count", type=int, default=serve["api_servers"],
                   help="API processes behind the one HTTP port, all routing to the same workers "
                        "(--api-server-count: vLLM's name)")
    p.add_argument("--stream-interval", type=int, default=serve["stream_interval"], metavar="N",
                   help="send a stream's tokens every N tokens (the first and the last at once), as vLLM's flag; "
                        "fewer, larger SSE events and less API CPU per token (default 1: every token)")
    p.add_argument("--max-logprobs", type=int, default=serve["max_logprobs"],
                   help="most logprobs (completions) or top_logprobs (chat) a request may ask; more is a 400; "
                        "-1: no cap below the 20 EPD returns at most")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted (needs --tool-call-parser hermes): EPD always serves tool_choice \"auto\"")
    p.add_argument("--tool-call-parser", default=None, metavar="|".join(TOOL_CALL_PARSERS),
                   help="how tool calls are read from the model's text: hermes <tool_call> blocks "
                        "(Qwen's format), the only one EPD has")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="accepted and logged: EPD never runs code from a checkpoint")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="accepted and logged: EPD always prefills in chunks (the --no- form is refused)")
    p.add_argument("--enable-log-requests", action="store_true",
                   help="log one line per request: id, endpoint, prompt size, sampling parameters")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="accepted: EPD logs no periodic stats (/metrics has them)")
    p.add_argument("--uvicorn-log-level", default=serve["uvicorn_log_level"], choices=list(UVICORN_LOG_LEVELS),
                   help="uvicorn's log level (info: an access line per request)")
    p.add_argument("--allowed-origins", default=None, metavar="JSON_LIST",
                   help="CORS origins, as vLLM's '[\"https://a.example\"]' (or comma-separated); "
                        "default: no CORS headers (browsers refuse cross-origin calls)")
    p.add_argument("--allowed-methods", default=None, metavar="JSON_LIST",
                   help="CORS methods, with --allowed-origins (default: [\"*\"])")
    p.add_argument("--allowed-headers", default=None, metavar="JSON_LIST",
                   help="CORS request headers, with --allowed-origins (default: [\"*\"])")
    p.add_argument("--allow-credentials", action="store_true",
                   help="CORS: allow credentials, with --allowed-origins")
    p.add_argument("--external-workers", action="store_true",
                   help="start no workers; wait for `epd worker` processes to register")
    p.add_argument("--worker-port", type=int, default=serve["worker_port"],
                   help="port workers register on (default: --port + 1)")
    p.add_argument("--worker-keys", default=None, metavar="DIR",
                   help="worker-plane keys made by `epd keys DIR` (needed with --external-workers: the worker "
                        "port is ZeroMQ CURVE, authenticated and encrypted; default: none)")
    p.add_argument("--cluster", default="local", choices=["local", "ray"],
                   help="local (default): worker processes on this machine; ray: every worker in a Ray actor, "
                        "placed by --*-resources (needs `pip install epd[ray]`)")
    p.add_argument("--ray-address", default=None, help="a running Ray cluster (default: start a local Ray)")
    for role, flag in ROLE_FLAGS.items():
        p.add_argument(flag, default=None, metavar="JSON",
                       help=f"Ray resources of one {role} worker{' (and pd / aggregated)' if role == 'prefill' else ''}"
                            f", e.g. '{{\"CPU\": 4}}', '{{\"GPU\": 0.5}}', '{{\"epd_{role}_node\": 1}}' "
                            f"(default '{{\"CPU\": 1}}')")
    p.add_argument("--threads-per-worker", type=int, default=serve["threads_per_worker"],
                   help="torch threads of each worker (None: from the cores and --cpu-sharing)")
    p.add_argument("--cpu-sharing", default=serve["cpu_sharing"], choices=list(CPU_SHARING),
                   help="shared (default): every worker may use every core, later stages first (decode, then "
                        "prefill, then encode); split: the cores divided over the workers")
    p.add_argument("--allowed-local-media-path", default=media["allowed_local_media_path"],
                   help="directory file:// image URLs may read from (default: file:// refused)")
    p.add_argument("--allowed-media-domains", default=None,
                   help="host1,host2: hosts http(s):// image URLs may be fetched from (default: none, refused)")
    p.add_argument("--media-fetch-timeout", type=float, default=media["fetch_timeout_s"],
                   help="seconds one http(s) image fetch may take, redirects included")
    p.add_argument("--max-image-bytes", type=int, default=media["max_image_bytes"],
                   help="refuse larger encoded images")
    p.add_argument("--max-image-pixels", type=int, default=media["max_image_pixels"],
                   help="refuse larger images (from the header)")
    p.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON|image=N",
                   help="items of each modality a request may hold, as vLLM's '{\"image\": 4, \"video\": 0}' or "
                        f"image=N (default: image {field_default(MediaConfig, 'limit_images_per_prompt')}, "
                        "video 0; video above 0 is refused until EPD serves video)")
    p.add_argument("--mm-processor-kwargs", default=None, metavar="JSON",
                   help="the image processor's settings over preprocessor_config.json's, e.g. "
                        "'{\"max_pixels\": 200704}': min_pixels, max_pixels (the API's placeholder counts and "
                        "the encoders alike)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="take the tokenizer (and its chat template) from this directory (default: the checkpoint)")
    p.add_argument("--max-request-pixels", type=int, default=field_default(MediaConfig, "max_request_pixels"),
                   help="pixels of all of a request's images together (from their headers)")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEXT",
                   help="the chat template, as vLLM's flag: a file, or the template itself (default: the "
                        "checkpoint's chat_template.json, chat_template.jinja, then tokenizer_config.json's)")
    p.add_argument("--generation-config", default=field_default(ModelFilesConfig, "generation_config"),
                   metavar="auto|vllm|DIR",
                   help="defaults for the sampling fields a request leaves out: auto, the checkpoint's "
                        "generation_config.json; vllm, neutral ones (temperature 1, top_p 1, top_k off); DIR, "
                        "DIR/generation_config.json (default: %(default)s)")
    p.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help="generation-config values on top of --generation-config's, e.g. "
                        "'{\"temperature\": 0.5, \"max_new_tokens\": 512}' (a max_new_tokens here also caps "
                        "every request's max_tokens)")
    limits = {name: field_default(ServingLimits, name) for name in (
        "request_timeout_s", "shutdown_grace_s", "max_pending_requests", "max_pending_image_bytes",
        "max_request_body_bytes", "max_restarts", "down_retry_s")}
    p.add_argument("--request-timeout", type=float, default=limits["request_timeout_s"],
                   help="seconds a request may take in all; then an error (503)")
    p.add_argument("--shutdown-grace", type=float, default=limits["shutdown_grace_s"],
                   help="on SIGTERM, seconds requests in flight may take to finish (new ones get 503)")
    p.add_argument("--max-pending-requests", type=int, default=limits["max_pending_requests"],
                   help="sequences in the server at once; more get 503 with Retry-After")
    p.add_argument("--max-pending-image-mb", type=float, default=limits["max_pending_image_bytes"] / (1 << 20),
                   help="raw image MiB of requests not yet prefilled; more get 503 with Retry-After")
    p.add_argument("--max-request-body-mb", type=float, default=limits["max_request_body_bytes"] / (1 << 20),
                   help="MiB of one HTTP request body; a larger one gets 413 before it is read (images inline "
                        "as data: URLs count; file:// and http(s):// URLs do not)")
    p.add_argument("--max-restarts", type=int, default=limits["max_restarts"],
                   help="restarts of one worker within a minute before its role is reported down")
    p.add_argument("--down-retry-interval", type=float, default=limits["down_retry_s"], metavar="SECONDS",
                   help="a worker given up on (its role down: requests needing it get 503 at once) is started "
                        "again this often")
    _add_engine_args(p)
    p.set_defaults(func=_serve)

    worker = {name: field_default(WorkerConfig, name) for name in (
        "host", "port", "mm_cache_dir", "mm_cache_gb", "max_image_pixels", "max_image_bytes", "num_threads",
        "cpu_sharing")}
    p = sub.add_parser("worker", help="one worker on this host, registering with a remote `epd serve`")
    p.add_argument("model", help="checkpoint directory")
    p.add_argument("--role", required=True, choices=[str(r) for r in Role])
    p.add_argument("--api", required=True, help="tcp://HOST:PORT of the API's worker port (with --api-servers N: "
                   "the N ports from the worker port up, joined by ',')")
    p.add_argument("--host", default=worker["host"], help="address to bind this worker's inbox on")
    p.add_argument("--port", type=int, default=worker["port"], help="inbox port (0: any free port)")
    p.add_argument("--mm-cache-dir", default=worker["mm_cache_dir"])
    p.add_argument("--mm-cache-gb", type=float, default=worker["mm_cache_gb"])
    p.add_argument("--max-image-pixels", type=int, default=worker["max_image_pixels"])
    p.add_argument("--max-image-bytes", type=int, default=worker["max_image_bytes"],
                   help="the largest image this worker takes (as the API's --max-image-bytes; a larger frame "
                        "disconnects its sender)")
    p.add_argument("--threads-per-worker", "--threads", dest="threads", type=int, default=worker["num_threads"],
                   help="torch threads (default: as `epd serve` gives a worker of this role alone on its host: "
                        "every core but one)")
    p.add_argument("--cpu-sharing", default=worker["cpu_sharing"], choices=list(CPU_SHARING),
                   help="shared (default): OMP_WAIT_POLICY=PASSIVE, so that waiting threads sleep instead of "
                        "spinning on cores other processes need (as `epd serve`); split: OpenMP's default")
    p.add_argument("--worker-keys", required=True, metavar="DIR",
                   help="worker-plane keys made by `epd keys DIR` (this host needs worker.key_secret)")
    _add_engine_args(p)
    p.set_defaults(func=_worker)

    p = sub.add_parser("keys", help="make the worker-plane keys (CURVE) for a multi-host deployment")
    p.add_argument("dir", help="new directory for api.key[_secret] and worker.key[_secret]")
    p.set_defaults(func=_keys)

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

    from epd.bench.plan import add_arguments as plan_arguments

    p = bench.add_parser("plan", help="predict the goodput of every E:P:D split of N workers from measured "
                                      "service times, then run the best for real")
    plan_arguments(p)
    p.set_defaults(func=_bench_plan)

    from epd.bench.cache_hit import add_arguments as cache_hit_arguments

    p = bench.add_parser("cache-hit", help="TTFT of a cached-image request vs a text-only one of equal length")
    cache_hit_arguments(p)
    p.set_defaults(func=_bench_cache_hit)

    from epd.bench.overhead import add_arguments as overhead_arguments

    p = bench.add_parser("overhead", help="served vs offline tokens/s on the same requests; API CPU per token")
    overhead_arguments(p)
    p.set_defaults(func=_bench_overhead)

    from epd.bench.fault import add_arguments as fault_arguments

    p = bench.add_parser("fault", help="kill one worker mid-trace: requests completed, recovered, failed, "
                                       "time until goodput is back")
    fault_arguments(p)
    p.set_defaults(func=_bench_fault)

    from epd.bench.body_memory import add_arguments as body_memory_arguments

    p = bench.add_parser("body-memory", help="the API process's peak memory and time for request bodies of "
                                             "1, 10, 100 MB")
    body_memory_arguments(p)
    p.set_defaults(func=_bench_body_memory)
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
