"""`epd bench serve`: open-loop load against an OpenAI-compatible server, goodput and latency.

Modelled on `vllm bench serve` (openai-chat backend): build the dataset,
check the server answers, send requests on a Poisson/gamma schedule
(optionally capped by `--max-concurrency`), then print the summary table and
write the result JSON (vLLM field names). HTTP only: it works against any
server that speaks `/v1/chat/completions` with SSE streaming. `--dataset
multi-turn` schedules conversations instead, each sending its turns one after
another (bench/multi_turn.py). When the server's /metrics has them, the run's
speculative decoding counters are in the result, and with multi-turn the
prefix cache's (a read of /metrics waits for the workers' stats to settle).
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import sys
import time
from dataclasses import replace
from datetime import datetime

import httpx

from epd.bench import multi_turn
from epd.bench.arrivals import arrival_times_s, parse_rate
from epd.bench.client import RequestResult, send_chat_request
from epd.bench.datasets import (BenchRequest, load_jsonl, load_tokenizer, parse_image_sizes, random_prompt,
                                sample_random, sample_random_mm, size_label)
from epd.bench.load import run_load
from epd.bench.metrics import LATENCY_METRICS, compute_metrics, parse_goodput, parse_percentiles
from epd.bench.prefix_cache_metrics import hit_rate_fields, parse_prefix_counters
from epd.bench.report import detailed_fields, format_table, write_result
from epd.bench.spec_metrics import acceptance_fields, parse_counters, read_counters
from epd.bench import vllm_names

DEFAULT_NUM_PROMPTS = 1000  # random datasets; a jsonl file defaults to all its lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `epd bench serve`."""
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (no /v1)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--dataset", "--dataset-name", dest="dataset", default="random-mm",
                   choices=["random-mm", "random", "jsonl", "multi-turn"],
                   help="multi-turn: conversations whose turns resend the history (see its flags below)")
    p.add_argument("--dataset-path", default=None, help="the jsonl file for --dataset jsonl")
    p.add_argument("--num-prompts", type=int, default=None,
                   help=f"requests to send (default {DEFAULT_NUM_PROMPTS}; jsonl: all lines)")
    p.add_argument("--request-rate", type=_argtype(parse_rate), default=math.inf,
                   help="requests/s, or 'inf' to send all at once (default inf)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival gaps: 1 = Poisson, <1 burstier, >1 more regular")
    p.add_argument("--max-concurrency", "--max-active-conversations", dest="max_concurrency", type=int,
                   default=None, help="cap on requests in flight (multi-turn: on conversations under way)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory for random prompts of exactly --input-len tokens "
                        "(default: --model when it is a local directory; without one, --input-len words)")
    p.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=1024,
                   help="random datasets: text tokens per prompt (images add their own)")
    p.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=128,
                   help="exact output tokens per request (jsonl: unless a line sets output_len)")
    p.add_argument("--images-per-request", "--random-mm-base-items-per-request", dest="images_per_request",
                   type=int, default=1, help="random-mm: K images per request")
    p.add_argument("--images-range-ratio", "--random-mm-num-mm-items-range-ratio", dest="images_range_ratio",
                   type=float, default=0.0,
                   help="random-mm: K drawn uniformly from [K(1-r), K(1+r)]")
    p.add_argument("--image-size", type=_argtype(parse_image_sizes), default=[(1024, 1024)],
                   help="random-mm: WxH[,WxH...], one chosen per image (default 1024x1024)")
    p.add_argument("--image-format", default="jpeg", choices=["jpeg", "png"], help="random-mm image encoding")
    p.add_argument("--repeat-image-ratio", type=float, default=0.0,
                   help="random-mm: share of images drawn from a pool of 8 fixed images (cache hits)")
    p.add_argument("--text-only-ratio", type=float, default=0.0,
                   help="random-mm: share of requests sent with no image (mixed traffic)")
    p.add_argument("--text-first", action="store_true",
                   help="random-mm: the text before the images in each message, as vLLM's bench sends "
                        "it (default: images first); early prefill can start only on text before an image")
    p.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000")
    p.add_argument("--percentiles", "--metric-percentiles", dest="percentiles", type=_argtype(parse_percentiles),
                   default=[50.0, 90.0, 99.0],
                   help="comma-separated percentiles to report (default 50,90,99)")
    p.add_argument("--save-result", nargs="?", const=True, default=None, metavar="FILE",
                   help="write the result JSON here (without FILE: in --result-dir, named as vLLM names it)")
    p.add_argument("--save-detailed", action="store_true", help="include per-request arrays in the JSON")
    p.add_argument("--seed", type=int, default=0, help="seeds the dataset and the arrival times")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per-request limit, seconds")
    p.add_argument("--no-progress", "--disable-tqdm", dest="no_progress", action="store_true",
                   help="no progress bar on stderr")
    multi_turn.add_arguments(p)
    vllm_names.add_arguments(p)


def main(args: argparse.Namespace) -> dict:
    """Run the benchmark described by `args`; print the table, save if asked, return the result.

    The returned dict always holds the per-request arrays; the saved file
    holds them only with `--save-detailed`. Bad flags raise ValueError.
    """
    args = vllm_names.resolve(args)
    slos_ms = parse_goodput(args.goodput) if args.goodput else {}
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not args.burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {args.burstiness}")
    if args.timeout_s <= 0:
        raise ValueError(f"--timeout-s must be > 0, got {args.timeout_s}")
    workload = build_conversations(args) if args.dataset == "multi-turn" else build_requests(args)
    model, turns, results, duration_s, counter_fields = asyncio.run(_run(args, workload))
    requests = [turn.request for turn in turns] if turns is not None else workload
    _warn_on_output_lengths(requests, results)
    result = _header(args, model, len(requests), duration_s, slos_ms)
    metrics = compute_metrics(results, duration_s, args.percentiles, slos_ms or None)
    result.update({k: v for k, v in metrics.items() if _reported(k, args.percentile_metrics)})
    result.update(counter_fields)  # the server's speculative decoding and prefix cache over the run, if reported
    if turns is not None:
        result["ttft_by_turn"] = multi_turn.ttft_by_turn(turns, args.percentiles)
    result.update(detailed_fields(results))
    if turns is not None:
        result.update(multi_turn.detailed_fields(turns))
    print(format_table(result, args.percentiles))
    if args.save_result:
        write_result(args.save_result, result, save_detailed=args.save_detailed,
                     append=getattr(args, "append_result", False))
    return result


def _header(args: argparse.Namespace, model: str, num_prompts: int, duration_s: float, slos_ms: dict) -> dict:
    """The run's description in the result JSON (vLLM's names, then EPD's dataset fields)."""
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": vllm_names.ENDPOINTS[args.endpoint_path],
        "label": getattr(args, "label", None),
        "base_url": args.server_root,
        "model_id": model,
        "tokenizer_id": tokenizer_path(args),  # None: prompts were counted in words
        "num_prompts": num_prompts,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "dataset": args.dataset,
        "seed": args.seed,
        "goodput_slos_ms": slos_ms or None,
        "duration": duration_s,
        **args.metadata,
    }
    if args.dataset != "jsonl":
        result.update(input_len=args.input_len, output_len=args.output_len)
    if args.dataset == "multi-turn":
        result.update(multi_turn.header_fields(args))
    if args.dataset == "random-mm":
        result.update(images_per_request=args.images_per_request, images_range_ratio=args.images_range_ratio,
                      image_sizes=[size_label(item) for item in args.image_size], image_format=args.image_format,
                      repeat_image_ratio=args.repeat_image_ratio, text_only_ratio=args.text_only_ratio)
    return result


def _reported(key: str, percentile_metrics: tuple[str, ...]) -> bool:
    """vLLM's --percentile-metrics: a latency metric's statistics are reported only when it is chosen."""
    return not any(key.endswith(f"_{name}_ms") and name not in percentile_metrics and not key.startswith(
        ("text_only_", "image_")) for name in LATENCY_METRICS)


def tokenizer_path(args: argparse.Namespace) -> str | None:
    if args.tokenizer:
        return args.tokenizer
    model = getattr(args, "model", None)
    return model if model and os.path.isfile(os.path.join(model, "tokenizer_config.json")) else None


def build_conversations(args: argparse.Namespace) -> list[multi_turn.Conversation]:
    """`--dataset multi-turn`'s conversations, seeded by `--seed`."""
    if args.dataset_path or args.num_prompts is not None:
        raise ValueError("--dataset multi-turn takes --num-conversations and --num-turns, "
                         "not --num-prompts or --dataset-path")
    unused = [flag for flag, is_set in (
        ("--random-range-ratio", getattr(args, "random_range_ratio", 0.0)), ("--random-prefix-len", args.prefix_len),
        ("--images-range-ratio", args.images_range_ratio), ("--repeat-image-ratio", args.repeat_image_ratio),
        ("--text-only-ratio", args.text_only_ratio),
        ("--random-mm-limit-mm-per-prompt", args.max_images is not None or args.max_videos is not None),
        ("--random-mm-bucket-config", args.image_weights is not None)) if is_set]
    if unused:
        raise ValueError(f"--dataset multi-turn does not take {', '.join(unused)} (see --system-prompt-len, "
                         "--images-every-turn)")
    tokenizer = load_tokenizer(tokenizer_path(args), getattr(args, "trust_remote_code", False))
    conversations = multi_turn.build_conversations(args, tokenizer)
    if args.text_first:
        conversations = [replace(c, turns=tuple(replace(t, text_first=True) for t in c.turns)) for c in conversations]
    return conversations


def build_requests(args: argparse.Namespace) -> list[BenchRequest]:
    """The dataset named by `--dataset`, seeded by `--seed`."""
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.output_len < 1:
        raise ValueError(f"--output-len must be >= 1, got {args.output_len}")
    if args.dataset == "jsonl":
        if not args.dataset_path:
            raise ValueError("--dataset jsonl needs --dataset-path FILE")
        return load_jsonl(args.dataset_path, args.num_prompts, args.output_len)
    if args.dataset_path:
        raise ValueError(f"--dataset-path is for --dataset jsonl, not {args.dataset}")
    if args.input_len < 1:
        raise ValueError(f"--input-len must be >= 1, got {args.input_len}")
    num_prompts = args.num_prompts or DEFAULT_NUM_PROMPTS
    tokenizer = load_tokenizer(tokenizer_path(args), getattr(args, "trust_remote_code", False))
    input_lens, output_lens = vllm_names.draw_lengths(args, num_prompts)
    if args.dataset == "random":
        requests = sample_random(num_prompts, args.input_len, args.output_len, seed=args.seed, tokenizer=tokenizer,
                                 input_lens=input_lens)
    else:
        requests = sample_random_mm(
            num_prompts, args.input_len, args.output_len, images_per_request=args.images_per_request,
            images_range_ratio=args.images_range_ratio, image_sizes=args.image_size,
            repeat_image_ratio=args.repeat_image_ratio, text_only_ratio=args.text_only_ratio,
            image_format=args.image_format, seed=args.seed, tokenizer=tokenizer, input_lens=input_lens,
            max_images=getattr(args, "max_images", None), image_weights=getattr(args, "image_weights", None),
            max_videos=getattr(args, "max_videos", None))
        requests = [replace(r, text_first=True) for r in requests] if args.text_first else requests
    prefix_len = getattr(args, "prefix_len", 0)
    if prefix_len:  # one fixed random prefix for all (vLLM's --random-prefix-len), from a stream of its own
        prefix = random_prompt(random.Random(f"prefix-{args.seed}"), prefix_len, tokenizer)
        requests = [replace(r, prompt=f"{prefix} {r.prompt}") for r in requests]
    if output_lens:
        requests = [replace(r, output_len=n) for r, n in zip(requests, output_lens)]
    return requests


async def _run(args: argparse.Namespace, workload: list) -> tuple[str, list | None, list[RequestResult], float, dict]:
    """Send `workload` (requests, or multi-turn conversations); (model, the conversations' turns or None,
    the results in order, the run's seconds, the server's counter fields)."""
    url = args.url
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)  # httpx caps at 100 otherwise
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(args.timeout_s)) as http:
        model = (getattr(args, "served_model_name", None) or args.model
                 or await _first_model(http, args.server_root, headers))

        async def send(request: BenchRequest, run_start_s: float = 0.0) -> RequestResult:
            return await send_chat_request(http, url, model, request, api_key=args.api_key,
                                           timeout_s=args.timeout_s, run_start_s=run_start_s,
                                           sampling=args.sampling)

        await _check_ready(send, url, getattr(args, "ready_check_timeout_sec", 0.0))
        for warmup in _warmups(args, workload):  # vLLM's --num-warmups: first, unmeasured
            await send(warmup)
        times_s = arrival_times_s(len(workload), args.request_rate, args.burstiness, seed=args.seed)
        parse = _parse_counters if args.dataset == "multi-turn" else _parse_spec_counters
        before = await read_counters(http, args.server_root, headers, settle=True, parse=parse)
        turns = None
        if args.dataset == "multi-turn":
            turns, duration_s = await multi_turn.run_conversations(
                workload, times_s, send, max_concurrency=args.max_concurrency, progress=not args.no_progress)
            results = [turn.result for turn in turns]
        else:
            results, duration_s = await run_load(workload, times_s, send, max_concurrency=args.max_concurrency,
                                                 progress=not args.no_progress)
        after = (await read_counters(http, args.server_root, headers, settle=True, parse=parse)
                 if before is not None else None)
    before, after = before or {}, after or {}
    return model, turns, results, duration_s, {**acceptance_fields(before.get("spec"), after.get("spec")),
                                               **hit_rate_fields(before.get("prefix"), after.get("prefix"))}


def _parse_spec_counters(text: str) -> dict | None:
    counters = parse_counters(text)
    return None if counters is None else {"spec": counters}


def _parse_counters(text: str) -> dict | None:
    """The counters the result reports from the server's /metrics: speculative decoding's and the prefix cache's."""
    counters = {"spec": parse_counters(text), "prefix": parse_prefix_counters(text)}
    return counters if any(v is not None for v in counters.values()) else None


def _warmups(args: argparse.Namespace, workload: list) -> list[BenchRequest]:
    """The first requests (unmeasured); multi-turn: single random turns, no prefix of the conversations'."""
    num_warmups = getattr(args, "num_warmups", 0)
    if args.dataset != "multi-turn":
        return workload[:num_warmups]
    rng = random.Random(f"warmup-{args.seed}")
    return [BenchRequest(random_prompt(rng, args.input_len), args.output_len) for _ in range(num_warmups)]


async def _check_ready(send, url: str, timeout_s: float) -> None:
    """One test request (vLLM's); with --ready-check-timeout-sec, tried again until it answers."""
    deadline = time.monotonic() + timeout_s
    while True:
        probe = await send(BenchRequest("Hello", 2))
        if probe.success:
            return
        if time.monotonic() >= deadline:
            raise ValueError(f"test request to {url} failed: {probe.error}")
        await asyncio.sleep(1.0)


async def _first_model(http: httpx.AsyncClient, base_url: str, headers: dict) -> str:
    url = f"{base_url}/v1/models"
    try:
        response = await http.get(url, headers=headers)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"cannot get the model name from {url} ({type(exc).__name__}: {exc}); "
                         "is the server up? pass --model to skip this") from None


def _warn_on_output_lengths(requests: list[BenchRequest], results: list[RequestResult]) -> None:
    wrong = sum(r.success and r.output_len != q.output_len for q, r in zip(requests, results))
    if wrong:
        print(f"warning: {wrong} requests returned a different number of tokens than asked "
              "(does the server honour ignore_eos / min_tokens?)", file=sys.stderr)
    failed = [r.error for r in results if not r.success]
    for i, error in enumerate(failed[:5]):
        print(f"error {i}: {error}", file=sys.stderr)


def _argtype(parse):
    """An argparse `type=` from a parser that raises ValueError with a clear message."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = parse.__name__
    return convert
