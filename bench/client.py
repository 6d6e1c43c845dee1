"""One streaming OpenAI chat request, timed from the client: TTFT, ITLs, E2EL.

The request asks for exactly `output_len` tokens (`max_tokens` and vLLM's
`min_tokens`, with `ignore_eos`), streams with `stream_options.include_usage`
so the final chunk carries the server's token counts, and never raises:
HTTP errors, error chunks, broken streams and timeouts all come back as a
`RequestResult` with `success=False` and a message in `error`.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from epd.bench.datasets import BenchRequest


@dataclass
class RequestResult:
    """What the client saw for one request. Times are seconds (perf_counter differences).

    `start_s` is when the request was sent, relative to the start of the run;
    `ttft_s` is from sending to the first content token; `itls_s` are the gaps
    between successive content chunks; `e2el_s` is sending to the end of the
    stream. `input_len` / `output_len` are the server's usage counts
    (`output_len` falls back to the number of content chunks when the
    server sends no usage).
    """

    success: bool = False
    start_s: float = 0.0
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    itls_s: list[float] = field(default_factory=list)
    input_len: int = 0
    output_len: int = 0
    num_images: int = 0
    generated_text: str = ""
    error: str = ""


def build_payload(model: str, request: BenchRequest, sampling: dict | None = None, *,
                  completions: bool = False) -> dict:
    """The JSON body of `POST /v1/chat/completions` for `request` (images, then text,
    or the other way round with `request.text_first`); with `completions`, of
    `POST /v1/completions` (text only). `sampling`: fields that replace greedy
    (temperature, top_p, top_k, min_p)."""
    body: dict = {"model": model}
    if completions:
        if request.image_urls:
            raise ValueError("/v1/completions takes no images: use the chat endpoint for image datasets")
        body["prompt"] = request.prompt
    else:
        body["messages"] = [*request.history, user_message(request)]
        if request.session_id is not None:
            body["user"] = request.session_id  # vLLM's router keys session affinity on it
    return {
        **body,
        "max_tokens": request.output_len,
        "min_tokens": request.output_len,  # vLLM extra: exact output length
        "ignore_eos": True,  # vLLM extra
        "temperature": 0.0,
        **(sampling or {}),
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def user_message(request: BenchRequest) -> dict:
    """`request`'s user turn as an OpenAI chat message."""
    return {"role": "user", "content": _content(request)}


def _content(request: BenchRequest) -> str | list[dict]:
    if not request.image_urls:
        return request.prompt
    images = [{"type": "video_url", "video_url": {"url": url}} if url.startswith("data:video/")
              else {"type": "image_url", "image_url": {"url": url}} for url in request.image_urls]
    text = [{"type": "text", "text": request.prompt}]
    return text + images if request.text_first else images + text


def is_completions_url(url: str) -> bool:
    """Whether `url` is a `/v1/completions` endpoint (prompt in, `text` chunks out) rather than chat."""
    return url.rstrip("/").endswith("/completions") and not url.rstrip("/").endswith("/chat/completions")


async def send_chat_request(http: httpx.AsyncClient, url: str, model: str, request: BenchRequest, *,
                            api_key: str | None = None, timeout_s: float | None = None,
                            run_start_s: float = 0.0, sampling: dict | None = None) -> RequestResult:
    """Send `request` to `url` (the full chat-completions or completions URL) and time its stream.

    `timeout_s` bounds the whole request; `run_start_s` is the
    `time.perf_counter()` of the run start, so `start_s` is relative to it.
    """
    result = RequestResult(num_images=request.num_images)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if request.session_id is not None:
        headers["x-session-id"] = request.session_id  # what a cache-aware router keys affinity on
    start = time.perf_counter()
    result.start_s = start - run_start_s
    try:
        payload = build_payload(model, request, sampling, completions=is_completions_url(url))
        await asyncio.wait_for(_stream(http, url, payload, headers, start, result),
                               timeout=timeout_s)
    except asyncio.TimeoutError:
        result.success, result.error = False, f"timeout after {timeout_s:g} s"
    except Exception as exc:  # connection refused, reset, protocol errors: a failed request, not a crash
        result.success, result.error = False, f"{type(exc).__name__}: {exc}"
    result.e2el_s = time.perf_counter() - start
    return result


async def _stream(http: httpx.AsyncClient, url: str, payload: dict, headers: dict, start: float,
                  result: RequestResult) -> None:
    num_chunks = 0
    last = start
    text_parts: list[str] = []
    usage: dict | None = None
    async with http.stream("POST", url, json=payload, headers=headers) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode("utf-8", "replace")
            result.error = f"HTTP {response.status_code}: {_error_message(body)}"
            return
        done = False
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments, `event:` lines
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                done = True
                break
            try:
                chunk = json.loads(data)
            except json.JSONDecodeError:
                result.error = f"bad SSE chunk: {data[:200]!r}"
                return
            if "error" in chunk:
                result.error = f"stream error: {_error_message(json.dumps(chunk))}"
                return
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                piece = delta.get("content") or delta.get("reasoning_content") or choice.get("text")
                if not piece:
                    continue
                now = time.perf_counter()
                if num_chunks == 0:
                    result.ttft_s = now - start
                else:
                    result.itls_s.append(now - last)
                last = now
                num_chunks += 1
                text_parts.append(piece)
    result.generated_text = "".join(text_parts)
    if not done:
        result.error = "stream ended without [DONE]"
        return
    if num_chunks == 0:
        result.error = "no content tokens in stream"
        return
    result.input_len = int((usage or {}).get("prompt_tokens") or 0)
    result.output_len = int((usage or {}).get("completion_tokens") or num_chunks)
    result.success = True


def _error_message(body: str) -> str:
    """The `message` of an OpenAI error body, else the body itself (shortened)."""
    try:
        obj = json.loads(body)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        message = err.get("message") if isinstance(err, dict) else None
        if message:
            return str(message)
        if isinstance(obj, dict) and "detail" in obj:
            return str(obj["detail"])
    except (json.JSONDecodeError, AttributeError):
        pass
    return body[:500]
