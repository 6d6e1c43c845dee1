"""A minimal real OpenAI-style streaming server (starlette + uvicorn on 127.0.0.1) for bench tests
(tests/unit/bench/conftest.py makes it the `fake_server` fixture).

It serves /health (200), /v1/chat/completions and /v1/completions (the same, with
`text` chunks), streaming one content chunk per requested token with a small sleep, then
a finish chunk, a usage chunk (`prompt_tokens` = prompt words +
TOKENS_PER_IMAGE per image) and `[DONE]`. A prompt containing "FAIL" gets an
HTTP 400 with an OpenAI error body. It records every request body and its
headers, and the peak number of streams in flight.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

TOKENS_PER_IMAGE = 16
MODEL_NAME = "fake-model"


@dataclass
class FakeServerState:
    base_url: str = ""
    token_delay_s: float = 0.002
    payloads: list[dict] = field(default_factory=list)
    headers: list[dict] = field(default_factory=list)  # each request's, lower-case names
    in_flight: int = 0
    peak_in_flight: int = 0


def _prompt_of(body: dict) -> tuple[str, int]:
    if "prompt" in body:  # /v1/completions
        return body["prompt"], 0
    content = body["messages"][-1]["content"]
    if isinstance(content, str):
        return content, 0
    text = " ".join(p["text"] for p in content if p["type"] == "text")
    return text, sum(p["type"] == "image_url" for p in content)


def _app(state: FakeServerState) -> Starlette:
    async def health(_: Request) -> JSONResponse:
        return JSONResponse({})

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": MODEL_NAME, "object": "model"}]})

    async def chat(request: Request):
        body = await request.json()
        state.payloads.append(body)
        state.headers.append(dict(request.headers))
        prompt, num_images = _prompt_of(body)
        if "FAIL" in prompt:
            return JSONResponse({"error": {"message": "bad prompt FAIL", "type": "invalid_request_error",
                                           "code": 400}}, status_code=400)
        num_tokens = body["max_tokens"]
        usage = {"prompt_tokens": len(prompt.split()) + TOKENS_PER_IMAGE * num_images,
                 "completion_tokens": num_tokens, "total_tokens": 0}

        def sse(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        completions = request.url.path == "/v1/completions"

        def chunk(delta: dict, finish: str | None = None) -> str:
            if completions:  # text_completion chunks carry `text`, not a delta
                choice = {"index": 0, "text": delta.get("content", ""), "finish_reason": finish}
                return sse({"id": "c", "object": "text_completion", "created": int(time.time()),
                            "model": MODEL_NAME, "choices": [choice]})
            return sse({"id": "c", "object": "chat.completion.chunk", "created": int(time.time()),
                        "model": MODEL_NAME, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

        async def stream():
            state.in_flight += 1
            state.peak_in_flight = max(state.peak_in_flight, state.in_flight)
            try:
                yield chunk({"role": "assistant", "content": ""})  # no content: not the first token
                for i in range(num_tokens):
                    await asyncio.sleep(state.token_delay_s)
                    yield chunk({"content": f"t{i} "})
                yield chunk({}, finish="length")
                yield sse({"id": "c", "object": "chat.completion.chunk", "model": MODEL_NAME, "choices": [],
                           "usage": usage})
                yield "data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(routes=[Route("/health", health), Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/completions", chat, methods=["POST"])])


@contextmanager
def running_fake_server() -> Iterator[FakeServerState]:
    """A running fake server; yields its `FakeServerState` (with `base_url`)."""
    state = FakeServerState()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    state.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(_app(state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)
    try:
        yield state
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
