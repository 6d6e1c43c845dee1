"""The OpenAI-compatible app under a real uvicorn in this process, in front of a
fake orchestrator (tests/unit/api/: the HTTP edge alone; tests/e2e/ runs it
with real workers).

`FakeOrchestrator` stands in for epd.serve.orchestrator: it implements
`OrchestratorLike` deterministically, answering every sequence with tokens
10, 11, ... (shifted by the seed), text " w<id>" per token, finishing with
"stop" after 5 tokens or "length" at max_tokens. Prompt words steer it:
BAD -> RequestError before any Delta, CRASH -> RuntimeError before any Delta,
CRASHLATER -> RuntimeError after two tokens, ABORTLATER -> finish_reason "abort" at the
third token (a worker aborted the request), SLOW -> 20 ms per token and 1000
tokens (for disconnects).
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time

import httpx
import uvicorn

from epd.api.fast_path import http_protocol
from epd.api.protocol import Delta, GenerateRequest, RequestError
from epd.api.server import ApiSettings, build_app
from epd.transport.wire.lora_request import LoRARequest
from epd.transport.wire.sampling import TokenLogprobs

MODEL = "qwen3-vl-test"
API_KEY = "sk-test"
NUM_STOP_TOKENS = 5
AUTH = {"Authorization": f"Bearer {API_KEY}"}


class FakeOrchestrator:
    model_name = MODEL
    max_model_len = 4096
    vocab_size = 1000

    def __init__(self):
        self.healthy = True
        self.requests: list[GenerateRequest] = []
        self.closed: set[str] = set()  # request ids whose generator ran its finally
        self.lora_updates: list[tuple[LoRARequest, bool]] = []  # (adapter, is_load) as announced to workers

    async def update_lora(self, lora: LoRARequest, is_load: bool) -> None:
        """A directory named "bad*" fails the check, as the orchestrator's check_lora_modules would."""
        if is_load and os.path.basename(lora.lora_path).startswith("bad"):
            raise ValueError(f"LoRA adapter {lora.lora_name!r} ({lora.lora_path}): r = 64 is above --max-lora-rank 16")
        self.lora_updates.append((lora, is_load))

    def missing_roles(self) -> list[str]:
        return [] if self.healthy else ["decode"]

    def metrics_text(self) -> bytes:
        return b"# TYPE epd:num_requests_running gauge\nepd:num_requests_running 0.0\n"

    def decode_token(self, token_id: int) -> str:
        return f" w{token_id}"

    async def tokenize(self, request: GenerateRequest, add_special_tokens: bool = False) -> list[int]:
        """As many tokens as generate() counts in the prompt (one more with special tokens)."""
        self.requests.append(request)
        text = request.prompt if request.messages is None else json.dumps(request.messages)
        if "BAD" in text:
            raise RequestError("the prompt is BAD", param="messages")
        return list(range(100, 100 + len(text.split()))) + ([1] if add_special_tokens else [])

    def detokenize(self, token_ids: list[int]) -> str:
        return "".join(self.decode_token(t) for t in token_ids)

    def token_strs(self, token_ids: list[int]) -> list[str]:
        return [f"w{t}" for t in token_ids]

    async def generate(self, request: GenerateRequest):
        self.requests.append(request)
        text = request.prompt if request.messages is None else json.dumps(request.messages)
        if "BAD" in text:
            raise RequestError("the prompt is BAD", param="messages")
        if "CRASH" in text and "CRASHLATER" not in text:
            raise RuntimeError("secret internal detail")
        num_prompt = len(text) if isinstance(text, list) else len(text.split())
        slow = "SLOW" in text
        num_stop = 1000 if slow else NUM_STOP_TOKENS
        limit = request.sampling.max_tokens or self.max_model_len - num_prompt
        k = request.sampling.logprobs
        try:
            for i in range(min(num_stop, limit)):
                await asyncio.sleep(0.02 if slow else 0)
                if "CRASHLATER" in text and i == 2:
                    raise RuntimeError("secret internal detail")
                tid = 10 + i + (request.sampling.seed or 0)
                finish = None if i + 1 < min(num_stop, limit) else ("stop" if num_stop <= limit else "length")
                if "ABORTLATER" in text and i == 2:
                    yield Delta(text="", token_ids=[], finish_reason="abort", num_prompt_tokens=num_prompt)
                    return
                logprobs = None if k is None else [
                    TokenLogprobs(tid, -0.25, 1, [(tid + j, -0.25 * (j + 1)) for j in range(k)])]
                yield Delta(text=self.decode_token(tid), token_ids=[tid], finish_reason=finish,
                            num_prompt_tokens=num_prompt, num_cached_tokens=2, logprobs=logprobs)
        finally:
            self.closed.add(request.request_id)


def serve_app(fake: FakeOrchestrator, lean_routes: bool = True, max_body_bytes: int = 64 << 20,
              metrics_require_key: bool = False, **settings):
    """Serves the app on a free port until the generator is closed: yields (base URL, fake) once."""
    settings = ApiSettings(**{"served_model_name": MODEL, **settings}, api_key=API_KEY,
                           max_request_body_bytes=max_body_bytes, metrics_require_key=metrics_require_key)
    app = build_app(fake, settings, lean_routes=lean_routes)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    # the HTTP protocol `epd serve` runs (writes joined per event-loop pass)
    uv = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off", http=http_protocol()))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", fake
    uv.should_exit = True
    thread.join(timeout=5)

def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def expected_text(num_tokens: int = NUM_STOP_TOKENS, seed: int = 0) -> str:
    return "".join(f" w{10 + i + seed}" for i in range(num_tokens))


def wait_until(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True

def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


JSON = {"content-type": "application/json"}
COMPLETION = {"model": MODEL, "prompt": "a b", "max_tokens": 3}
CHAT = {"model": MODEL, "messages": user("hi")}
