"""`vllm bench serve`'s names for the options `epd bench serve` shares with it.

A `vllm bench serve` command line runs here unchanged for the options both
have, and the result JSON keeps vLLM's field names (bench/metrics.py). Three
kinds of vLLM flag:

* **Aliases** of an EPD flag (the same destination, in bench/serve.py):
  `--dataset-name` (--dataset), `--random-input-len` / `--random-output-len`
  (--input-len / --output-len), `--random-mm-base-items-per-request`
  (--images-per-request), `--random-mm-num-mm-items-range-ratio`
  (--images-range-ratio), `--metric-percentiles` (--percentiles),
  `--disable-tqdm` (--no-progress); `--save-result` without a file name
  writes to `--result-dir` / `--result-filename` as vLLM names it.
* **Their own meaning, as vLLM's** (added here, resolved by `resolve`):
  `--host` / `--port`, `--endpoint`, `--backend`, `--random-range-ratio`,
  `--random-prefix-len`, `--random-mm-limit-mm-per-prompt`,
  `--random-mm-bucket-config`, `--temperature` / `--top-p` / `--top-k` /
  `--min-p`, `--percentile-metrics`, `--result-dir`, `--result-filename`,
  `--append-result`, `--metadata`, `--label`, `--num-warmups`,
  `--served-model-name`, `--trust-remote-code`, `--ready-check-timeout-sec`.
  `--ignore-eos` is accepted and always in effect: EPD's bench asks for
  exact output lengths (`ignore_eos` and `min_tokens`) so that runs compare.
* **Anything else** vLLM has (`--profile`, other datasets, ...) is refused by
  argparse with a message naming the flag: never silently ignored.

`--random-mm-bucket-config` keys are vLLM's `(H, W, T)`: T = 1 an image of
W x H, T > 1 a video of T frames of W x H (a real mp4, as vLLM's: bench/datasets.py
make_video_bytes), sent as a `video_url` part; `--random-mm-limit-mm-per-prompt`
caps each modality per request, vLLM's way (a modality at its cap is drawn no
more in that request).

Refused with a clear message: an audio bucket (H = 0) or one of no frames, an
endpoint other than chat or completions, an image dataset on the completions
endpoint.
"""
from __future__ import annotations

import argparse
import ast
import copy
import json
import math
import random
from datetime import datetime
from pathlib import Path

from epd.bench.metrics import LATENCY_METRICS

ENDPOINTS = {"/v1/chat/completions": "openai-chat", "/v1/completions": "openai"}
BACKENDS = {"openai-chat": "/v1/chat/completions", "vllm-chat": "/v1/chat/completions",
            "openai": "/v1/completions", "vllm": "/v1/completions"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The vLLM flags that are not aliases of an EPD flag."""
    g = p.add_argument_group("vllm bench serve's names")
    g.add_argument("--host", default=None, help="server host (with --port: replaces --base-url's)")
    g.add_argument("--port", type=int, default=None, help="server port (with --host: replaces --base-url's)")
    g.add_argument("--endpoint", default=None, choices=sorted(ENDPOINTS),
                   help="API path (default: the backend's; chat unless --backend openai)")
    g.add_argument("--backend", default=None, choices=sorted(BACKENDS),
                   help="openai-chat (default): /v1/chat/completions; openai: /v1/completions (text only)")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="input and output lengths drawn uniformly from [L(1-r), L(1+r)] per request")
    g.add_argument("--random-prefix-len", type=int, default=0,
                   help="tokens of one fixed random prefix before every prompt")
    g.add_argument("--random-mm-limit-mm-per-prompt", type=_json_object, default=None, metavar="JSON",
                   help='per-modality cap on items per request, e.g. \'{"image": 3, "video": 0}\'')
    g.add_argument("--random-mm-bucket-config", type=_buckets, default=None, metavar="DICT",
                   help="{(height, width, num_frames): probability}: item sizes by probability "
                        "(num_frames 1: an image; more: an mp4 video of that many frames)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="accepted: EPD's bench always asks for exact output lengths")
    for name, kind in (("--temperature", float), ("--top-p", float), ("--top-k", int), ("--min-p", float)):
        g.add_argument(name, type=kind, default=None, help="sampling parameter sent with every request "
                                                           "(default: greedy)")
    g.add_argument("--percentile-metrics", default=None,
                   help=f"comma-separated metrics to report percentiles of, among {','.join(LATENCY_METRICS)} "
                        "(default: all)")
    g.add_argument("--result-dir", default=None, help="directory of the --save-result file")
    g.add_argument("--result-filename", default=None, help="name of the --save-result file")
    g.add_argument("--append-result", action="store_true", help="append the result to the file as a JSON line")
    g.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE",
                   help="key-value pairs recorded in the result JSON")
    g.add_argument("--label", default=None, help="recorded in the result JSON and its default file name")
    g.add_argument("--num-warmups", type=int, default=0, help="requests sent (and not measured) first")
    g.add_argument("--served-model-name", default=None,
                   help="model name sent in requests (default: --model, or the server's first)")
    g.add_argument("--trust-remote-code", action="store_true", help="let the tokenizer run its own code")
    g.add_argument("--ready-check-timeout-sec", type=float, default=0.0,
                   help="wait up to this long for the server to answer the test request (default: try once)")


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """A copy of `args` with the vLLM names folded into what bench/serve.py reads:
    `server_root`, `endpoint_path`, `url`, `sampling`, `image_weights`, `max_images`,
    `max_videos`, `prefix_len`, `percentile_metrics`, `save_result` (a path or None)."""
    out = copy.copy(args)
    opt = _Options(args)
    out.server_root, out.endpoint_path = opt.base_url().rstrip("/"), opt.endpoint_path()
    out.url = out.server_root + out.endpoint_path
    if opt.is_completions() and args.dataset in ("random-mm", "multi-turn"):
        raise ValueError(f"--dataset-name {args.dataset} needs the chat endpoint (--backend openai-chat)")
    out.sampling = {name: value for name, value in (("temperature", opt.get("temperature")),
                                                    ("top_p", opt.get("top_p")), ("top_k", opt.get("top_k")),
                                                    ("min_p", opt.get("min_p"))) if value is not None}
    out.image_size, out.image_weights = _image_sizes(args, opt.get("random_mm_bucket_config"))
    out.max_images, out.max_videos = _max_items(opt.get("random_mm_limit_mm_per_prompt"))
    ratio = opt.get("random_range_ratio", 0.0)
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    out.prefix_len = opt.get("random_prefix_len", 0)
    if out.prefix_len < 0:
        raise ValueError(f"--random-prefix-len must be >= 0, got {out.prefix_len}")
    out.percentile_metrics = _metrics(opt.get("percentile_metrics"))
    out.save_result = _save_path(args, opt)
    out.metadata = _metadata(opt.get("metadata"))
    if opt.get("num_warmups", 0) < 0:
        raise ValueError(f"--num-warmups must be >= 0, got {opt.get('num_warmups')}")
    return out


class _Options:
    """Reads a flag that may be absent (other benches build their namespace from serve's flags and more)."""

    def __init__(self, args: argparse.Namespace):
        self.args = args

    def get(self, name: str, default=None):
        return getattr(self.args, name, default)

    def base_url(self) -> str:
        host, port = self.get("host"), self.get("port")
        if host is None and port is None:
            return self.args.base_url
        return f"http://{host or '127.0.0.1'}:{port or 8000}"

    def endpoint_path(self) -> str:
        endpoint, backend = self.get("endpoint"), self.get("backend")
        if endpoint and backend and BACKENDS[backend] != endpoint:
            raise ValueError(f"--backend {backend} speaks {BACKENDS[backend]}, not --endpoint {endpoint}")
        return endpoint or (BACKENDS[backend] if backend else "/v1/chat/completions")

    def is_completions(self) -> bool:
        return self.endpoint_path() == "/v1/completions"


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc.msg}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _buckets(text: str) -> dict[tuple[int, int, int], float]:
    """vLLM's bucket syntax: a Python dict literal with (height, width, num_frames) keys,
    or JSON with those tuples written as strings."""
    try:
        raw = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise argparse.ArgumentTypeError(f"not a dict literal: {text!r}") from None
    if not isinstance(raw, dict) or not raw:
        raise argparse.ArgumentTypeError("expected a non-empty dict {(height, width, num_frames): probability}")
    out = {}
    for key, value in raw.items():
        if isinstance(key, str):
            key = ast.literal_eval(key)
        if (not isinstance(key, tuple) or len(key) != 3 or not all(isinstance(k, int) and k >= 0 for k in key)
                or not isinstance(value, (int, float)) or value < 0):
            raise argparse.ArgumentTypeError(f"bad bucket {key!r}: {value!r} (want (height, width, frames): p >= 0)")
        out[key] = float(value)
    return out


def _image_sizes(args, buckets: dict | None) -> tuple[list[tuple[int, ...]], list[float] | None]:
    """(sizes, weights): (width, height) an image, (width, height, frames) a video."""
    if buckets is None:
        return args.image_size, None
    live = {key: p for key, p in buckets.items() if p > 0}
    bad = [key for key in live if key[0] < 1 or key[1] < 1 or key[2] < 1]
    if bad:
        raise ValueError(f"--random-mm-bucket-config: buckets {bad} are not an image (H, W, 1) or a video (H, W, T) "
                         "of positive size (audio is not served)")
    if not live:
        raise ValueError("--random-mm-bucket-config: needs a bucket with a probability above 0")
    sizes = [(w, h) if frames == 1 else (w, h, frames) for h, w, frames in live]
    return sizes, list(live.values())  # normalised by random.choices


def _max_items(limits: dict | None) -> tuple[int | None, int | None]:
    """(images, videos) per request from --random-mm-limit-mm-per-prompt (None: no cap)."""
    if limits is None:
        return None, None
    unknown = sorted(set(limits) - {"image", "video"})
    bad = [k for k, v in limits.items() if not isinstance(v, int) or isinstance(v, bool) or v < 0]
    if unknown or bad:
        raise ValueError(f"--random-mm-limit-mm-per-prompt: want non-negative counts of image and video, "
                         f"got {limits}")
    return limits.get("image"), limits.get("video")


def draw_lengths(args, n: int) -> tuple[list[int] | None, list[int] | None]:
    """The `n` requests' input and output lengths as vLLM's random dataset draws them
    (--random-range-ratio r): uniform integers in [floor(L(1-r)), ceil(L(1+r))]; None when r is 0."""
    ratio = getattr(args, "random_range_ratio", 0.0)
    if ratio == 0.0 or args.dataset == "jsonl":
        return None, None
    rng = random.Random(f"lengths-{args.seed}")  # apart from the prompts' stream: r=0 draws what it always drew

    def draw(length: int) -> list[int]:
        low, high = max(1, math.floor(length * (1 - ratio))), max(1, math.ceil(length * (1 + ratio)))
        return [rng.randint(low, high) for _ in range(n)]
    return draw(args.input_len), draw(args.output_len)


def _metrics(text: str | None) -> tuple[str, ...]:
    if text is None:
        return LATENCY_METRICS
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in LATENCY_METRICS]
    if unknown or not names:
        raise ValueError(f"--percentile-metrics: unknown {unknown or text!r}; choose among {','.join(LATENCY_METRICS)}")
    return names


def _save_path(args, opt: _Options) -> str | None:
    """`--save-result FILE` (EPD's), or vLLM's flag with --result-dir / --result-filename."""
    save = args.save_result
    if isinstance(save, str):
        return save
    if not save:
        return None
    name = opt.get("result_filename") or _default_filename(args, opt)
    return str(Path(opt.get("result_dir") or ".") / name)


def _default_filename(args, opt: _Options) -> str:
    """vLLM's: {label or backend}-{rate}qps[-concurrency{N}]-{model}-{date}.json."""
    rate = args.request_rate if math.isfinite(args.request_rate) else "inf"
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    model = (opt.get("served_model_name") or args.model or "model").rstrip("/").split("/")[-1]
    label = opt.get("label") or ENDPOINTS[opt.endpoint_path()]
    return f"{label}-{rate}qps{concurrency}-{model}-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"


def _metadata(pairs: list[str] | None) -> dict[str, str]:
    out = {}
    for pair in pairs or []:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise ValueError(f"--metadata: want KEY=VALUE, got {pair!r}")
        out[key] = value
    return out
