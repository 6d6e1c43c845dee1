"""`python -m bench.dev.cache_hit`: TTFT of a request whose image is already in the
embedding cache, against a text-only request of the same prompt length.

Run it against a server started with `--no-enable-prefix-caching`: the same
prompts are sent repeatedly, and the prefix cache would otherwise serve them
whole. Then the image tokens are prefilled every time and only the encoder
work is saved by the embedding cache. The text-only prompt is padded with
" a" until the server counts the same number of prompt tokens. Requests run
one at a time against an otherwise idle server. HTTP only.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import httpx

from epd.bench.datasets import data_url, make_image_bytes, parse_image_sizes

WORDS = ("red chair window tree sky cat photo picture detail color light shadow table lamp river "
         "mountain city road car house garden flower bird cloud water stone").split()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None)
    p.add_argument("--image-size", type=parse_image_sizes, default=[(448, 448)])
    p.add_argument("--words", type=int, default=200, help="random words before the image")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def _prompt_tokens(http, url, model, messages) -> int:
    body = {"model": model, "messages": messages, "max_tokens": 1}
    response = await http.post(url, json=body)
    response.raise_for_status()
    return response.json()["usage"]["prompt_tokens"]


async def _run(args) -> dict:
    url = args.base_url.rstrip("/") + "/v1/chat/completions"
    rng = random.Random(args.seed)
    w, h = args.image_size[0]
    image = data_url(make_image_bytes(w, h, seed=args.seed, fmt="jpeg"), "image/jpeg")
    async with httpx.AsyncClient(timeout=600) as http:
        model = args.model or (await http.get(args.base_url.rstrip("/") + "/v1/models")).json()["data"][0]["id"]

        def image_messages(text):
            return [{"role": "user", "content": [{"type": "text", "text": text},
                                                 {"type": "image_url", "image_url": {"url": image}}]}]

        with_image = image_messages(_words(rng, args.words))
        target = await _prompt_tokens(http, url, model, with_image)  # also puts the image in the cache
        # Pad a text-only prompt to the same token count with " a" (one token in BPE vocabularies).
        base = _words(random.Random(args.seed + 1), max(1, args.words // 2))
        pad = None
        k = 0
        for _ in range(20):
            count = await _prompt_tokens(http, url, model, [{"role": "user", "content": base + " a" * k}])
            if count == target:
                pad = k
                break
            k = max(0, k + target - count)
        if pad is None:
            raise ValueError(f"could not match {target} prompt tokens with text only")
        hit_ttft, text_ttft = [], []
        for _ in range(args.repeats):
            for kind in ("image", "text"):
                messages = with_image if kind == "image" else [{"role": "user", "content": base + " a" * pad}]
                result = await _send(http, url, model, messages)
                (hit_ttft if kind == "image" else text_ttft).append(result)
    hit, text = statistics.median(hit_ttft), statistics.median(text_ttft)
    return {"prompt_tokens": target, "image_size": f"{w}x{h}", "repeats": args.repeats,
            "cache_hit_ttft_ms": hit * 1e3, "text_only_ttft_ms": text * 1e3, "ratio": hit / text}


async def _send(http, url, model, messages) -> float:
    """TTFT in seconds of one streamed request."""
    body = {"model": model, "messages": messages, "max_tokens": 2, "stream": True, "temperature": 0}
    start = time.perf_counter()
    async with http.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and '"content"' in line:
                return time.perf_counter() - start
    raise ValueError("stream ended without content")


def main(args) -> dict:
    result = asyncio.run(_run(args))
    print(f"prompt tokens {result['prompt_tokens']}: cache-hit image TTFT {result['cache_hit_ttft_ms']:.1f} ms, "
          f"text-only TTFT {result['text_only_ttft_ms']:.1f} ms -> {result['ratio']:.2f}x")
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.dev.cache_hit", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return parser


if __name__ == "__main__":
    main(build_parser().parse_args())
