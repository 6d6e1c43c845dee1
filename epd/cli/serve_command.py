"""`epd serve`: its flags (`add_serve_parser`), the ServeConfig they make (`serve_config`),
the checkpoint check before any process starts, and the run."""
from __future__ import annotations

import argparse
import sys

from epd.cli.engine_flags import HelpFormatter, add_engine_args, add_input_processing_args, engine_config
from epd.cli.video_flags import add_video_limit_args, video_limits
from epd.config import CPU_SHARING, TOOL_CALL_PARSERS, UVICORN_LOG_LEVELS, ServeConfig, ServingLimits, field_default
from epd.flag_values import json_object, limit_mm_per_prompt, media_io_kwargs, string_list
from epd.inputs.media import MediaConfig
from epd.inputs.model_files import ModelFilesConfig
from epd.lora_modules import check_lora_modules, parse_lora_modules
from epd.processes.autoscale import EncoderScaling
from epd.serve.encoder_router import ENCODER_ROUTERS
from epd.processes.ray_config import ROLE_FLAGS, RayConfig, parse_resources
from epd.serve.router import ROUTERS
from epd.transport.wire.roles import Mode


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="start the OpenAI-compatible server and its workers",
                       formatter_class=HelpFormatter)
    p.add_argument("model", help="checkpoint directory")
    serve = {name: field_default(ServeConfig, name) for name in (
        "mode", "num_encoders", "num_prefill", "num_decode", "host", "port", "mm_cache_dir", "mm_cache_gb", "router",
        "encoder_router", "served_model_name", "api_key", "metrics_require_key", "worker_port", "threads_per_worker", "cpu_sharing",
        "core_lease",
        "api_servers", "stream_interval", "max_logprobs", "uvicorn_log_level")}
    _add_worker_flags(p, serve)
    _add_api_flags(p, serve)
    _add_placement_flags(p, serve)
    _add_media_flags(p)
    _add_limit_flags(p)
    add_engine_args(p)
    p.set_defaults(func=_serve)


def _add_worker_flags(p: argparse.ArgumentParser, serve: dict) -> None:
    """How many workers of each role, where the HTTP server listens, the cache and the routers."""
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
    p.add_argument("--prefill-tensor-parallel-size", type=int, default=None,
                   help="e-p-d: the prefill workers' --tensor-parallel-size (default: --tensor-parallel-size)")
    p.add_argument("--decode-tensor-parallel-size", type=int, default=None,
                   help="e-p-d: the decode workers' --tensor-parallel-size (default: --tensor-parallel-size)")
    p.add_argument("--host", default=serve["host"], help="address the HTTP server binds")
    p.add_argument("--port", type=int, default=serve["port"], help="HTTP port")
    p.add_argument("--mm-cache-dir", default=serve["mm_cache_dir"],
                   help="embedding cache (LMDB) directory; kept across restarts")
    p.add_argument("--mm-cache-gb", type=float, default=serve["mm_cache_gb"],
                   help="GiB the embedding cache may hold (least recently used out first)")
    p.add_argument("--router", default=serve["router"], choices=list(ROUTERS),
                   help="how a request picks its prefill and decode workers: least_loaded (power of two "
                        "choices); round_robin; prefix_hash (its first 64 tokens); cache_aware (where the "
                        "longest prefix of it is cached when that is over half of it, else the least loaded, a "
                        "session kept on its worker by x-session-id or `user`; the engine workers report their "
                        "prefix caches)")
    p.add_argument("--encoder-router", default=serve["encoder_router"], choices=list(ENCODER_ROUTERS),
                   help="cost: each image to the encoder where it finishes first; round_robin: in turn")


def _add_api_flags(p: argparse.ArgumentParser, serve: dict) -> None:
    """What the HTTP API serves and whom: name, key, processes, streaming, vLLM's accepted flags, CORS."""
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
                   help="accepted (needs --tool-call-parser, as in vLLM): EPD always serves tool_choice \"auto\"")
    p.add_argument("--tool-call-parser", default=None, metavar="|".join(TOOL_CALL_PARSERS),
                   help="how tool_choice \"auto\" reads tool calls from the model's text (vLLM's names): "
                        "hermes <tool_call> JSON blocks (Qwen; the default), pythonic [f(x=1)] lists "
                        "(Llama 3.2, Gemma 3), glm45 <tool_call> blocks of <arg_key>/<arg_value> tags "
                        "(GLM-4.1V, GLM-4.5V), qwen3_coder <tool_call> blocks of <function=...>/<parameter=...> "
                        "tags (Qwen3.5, Qwen3.6)")
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
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="name=path|JSON",
                   help="LoRA adapters served by name (with --enable-lora): name=path, or vLLM's JSON "
                        "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; a request's model picks one")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with --enable-lora; vLLM "
                        "reads VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, EPD this flag)")


def _add_placement_flags(p: argparse.ArgumentParser, serve: dict) -> None:
    """Where the workers run: external, Ray, and their threads on this host."""
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
    p.add_argument("--core-lease", action=argparse.BooleanOptionalAction, default=serve["core_lease"],
                   help="shared (default on): CPU engine workers lend each other their cores while idle (a lone busy "
                        "one takes them all), not while the hypervisor steals over 10%% of the vCPUs' time "
                        "(docs/architecture.md, Cores); --no-core-lease: fixed threads")


def _add_media_flags(p: argparse.ArgumentParser) -> None:
    """Images (where they may come from, how large), the tokenizer, the chat template and sampling defaults."""
    media = {name: field_default(MediaConfig, name) for name in (
        "allowed_local_media_path", "fetch_timeout_s", "max_image_bytes", "max_image_pixels")}
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
                   help="items of each modality a request may hold, as vLLM's '{\"image\": 4, \"video\": 1}' or "
                        f"image=N (default: image {field_default(MediaConfig, 'limit_images_per_prompt')}, "
                        f"video {field_default(MediaConfig, 'limit_videos_per_prompt')}, "
                        f"audio {field_default(MediaConfig, 'limit_audios_per_prompt')}: a model that takes audio)")
    p.add_argument("--max-audio-seconds", type=float, default=field_default(MediaConfig, "max_audio_seconds"),
                   help="refuse longer audio clips (from the header, else the decoded samples); Qwen2.5-Omni's "
                        "processor keeps a clip's first 30 s, as transformers' does")
    _add_video_flags(p)
    add_input_processing_args(p)
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


def _add_video_flags(p: argparse.ArgumentParser) -> None:
    """What a video may be (size, frames, decoded pixels, decode time) and how its frames are taken."""
    add_video_limit_args(p)  # `epd worker`'s too
    p.add_argument("--media-io-kwargs", default=None, metavar="JSON",
                   help="vLLM's media loading arguments: '{\"video\": {\"num_frames\": N}}' takes N frames "
                        "evenly from each video before the processor sees them (-1, the default: every frame, "
                        "the processor samples)")
    p.add_argument("--video-chunk-frames", type=int, default=field_default(MediaConfig, "video_chunk_frames"),
                   metavar="N",
                   help="encode a video of more than N sampled frames in chunks of N (whole temporal groups), "
                        "each its own encode request, spread over the encoders; prefill starts on the first "
                        "chunk while the others encode (0, the default: one request per video)")


def _add_limit_flags(p: argparse.ArgumentParser) -> None:
    """What one request and the server may hold, and how long; worker restarts."""
    limits = {name: field_default(ServingLimits, name) for name in (
        "request_timeout_s", "shutdown_grace_s", "max_pending_requests", "max_pending_image_bytes",
        "max_request_body_bytes", "max_restarts", "down_retry_s", "max_request_worker_deaths")}
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
    p.add_argument("--max-request-worker-deaths", type=int, default=limits["max_request_worker_deaths"],
                   metavar="N", help="a request that was running on N workers as they died is failed with an "
                   "error instead of being sent again (a request whose item an encoder was encoding as it "
                   "died is failed at once when it was alone in the batch)")



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
        cpu_sharing=args.cpu_sharing, core_lease=args.core_lease, worker_keys=args.worker_keys, ray=ray_config(args),
        api_servers=args.api_servers, stream_interval=args.stream_interval,
        engine=engine_config(args), lora_modules=parse_lora_modules(args.lora_modules),
        prefill_tensor_parallel_size=args.prefill_tensor_parallel_size,
        decode_tensor_parallel_size=args.decode_tensor_parallel_size,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        media=MediaConfig(allowed_local_media_path=args.allowed_local_media_path,
                          allowed_media_domains=_domains(args.allowed_media_domains),
                          max_image_bytes=args.max_image_bytes, max_image_pixels=args.max_image_pixels,
                          fetch_timeout_s=args.media_fetch_timeout,
                          limit_images_per_prompt=limits["image"], limit_videos_per_prompt=limits["video"],
                          limit_audios_per_prompt=limits["audio"], max_audio_seconds=args.max_audio_seconds,
                          max_request_pixels=args.max_request_pixels,
                          video_chunk_frames=args.video_chunk_frames,
                          **video_limits(args), **media_io_kwargs(args.media_io_kwargs)),
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
                             max_restarts=args.max_restarts, down_retry_s=args.down_retry_interval,
                             max_request_worker_deaths=args.max_request_worker_deaths))


def ray_config(args) -> RayConfig | None:
    """`--cluster ray` and its flags (epd/processes/ray_config.py); None for the local launcher."""
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
    from epd.processes.launcher import serve

    config = serve_config(args)
    check_checkpoint(config)
    return serve(config)


def check_checkpoint(config: ServeConfig) -> None:
    """Refuses (ValueError, one line) a checkpoint this deployment cannot serve, before
    any process starts; prints what the files say (warnings, sampling defaults)."""
    from epd.inputs.model_files import ModelFiles

    from epd.engine.spec.check import check_speculative_model

    files = ModelFiles.open(config.model, config.files)
    config.engine.resolved_max_model_len(files.max_position_embeddings)
    check_speculative_model(config.engine.speculative_config, config.model, config.files.tokenizer, files.hf_config)
    lora = config.engine.lora
    check_lora_modules(config.lora_modules, config.model_name, files.hf_config, lora.max_lora_rank,
                       lora.enable_tower_lora)
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
                     "\"auto\" is always served, reading the model's calls in that format")
    if config.enable_chunked_prefill:
        notes.append("--enable-chunked-prefill: accepted; EPD always prefills in chunks of at most "
                     f"--max-num-batched-tokens ({config.engine.scheduler.max_num_batched_tokens}) a step")
    if config.disable_log_stats:
        notes.append("--disable-log-stats: accepted; EPD logs no periodic stats (/metrics has them)")
    return notes
