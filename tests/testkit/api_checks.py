"""Constants and helpers for checking `epd serve` over plain HTTP: the bodies
sent, the OpenAI error shape expected back, and what the server's log and
metrics say about its workers. Used by tests/e2e/hardening/."""
from __future__ import annotations

import json
import re
import subprocess
import time

import httpx
from testkit.media import image_bytes, image_part
from testkit.server import ServerProcess

MODEL = "epd-hardened"
MAX_MODEL_LEN = 4000  # the tiny checkpoint's own limit is 4096
MAX_IMAGE_BYTES = 1_000_000
MAX_IMAGE_PIXELS = 4_000_000
MAX_REQUEST_PIXELS = 200_000  # two 256x256 images pass, two 400x300 do not
MAX_TOKENS = 4
MAX_VIDEO_MB = 0.1  # tests/e2e/hardening/test_video_media.py
MAX_VIDEO_FRAMES = 40
IMG = image_bytes(64, 48, seed=3)
TEXT_MESSAGES = [{"role": "user", "content": "Say something about boats."}]
IMAGE_MESSAGES = [{"role": "user", "content": [image_part(IMG), {"type": "text", "text": "Describe it."}]}]
HUGE_BODY_BYTES = 50 * 1024 * 1024
MAX_BODY_MB = 4  # --max-request-body-mb of the hardening server
ERROR_KEYS = {"message", "type", "param", "code"}
COMMON = ["--num-kv-blocks", "512", "--dtype", "float32", "--device", "cpu", "--threads-per-worker", "1"]


def plain_server_model(srv) -> str:
    r = httpx.get(srv.base_url + "/v1/models", headers={"authorization": "Bearer sk-hardening"})
    return r.json()["data"][0]["id"]


def chat_body(messages, **fields) -> dict:
    return {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, **fields}


def post(server, body=None, *, content: bytes | None = None, stream: bool = False, headers=None,
         path: str = "/v1/chat/completions") -> httpx.Response:
    if body is not None and stream:
        body = {**body, "stream": True}
    kwargs = {"json": body} if content is None else {"content": content}
    return httpx.post(server.base_url + path, headers={"content-type": "application/json", **(headers or {})},
                      timeout=60, **kwargs)


def answer_text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    if response.headers["content-type"].startswith("text/event-stream"):
        chunks = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: {")]
        assert all("error" not in c for c in chunks), response.text
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return response.json()["choices"][0]["message"]["content"]


def assert_error(response: httpx.Response, status: int, message: str = "", param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS
    assert message.lower() in error["message"].lower(), error
    if param is not None:
        assert error["param"] == param
    return error


def assert_still_serving(server, expected, kind: str = "text") -> None:
    messages = TEXT_MESSAGES if kind == "text" else IMAGE_MESSAGES
    assert answer_text(post(server, chat_body(messages))) == expected[kind]


def messages_with(*parts) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}]


def url_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def worker_sockets(srv: ServerProcess) -> dict[str, str]:
    """{"api": collector address, "<worker id>": inbox address} from the server's log."""
    match = re.search(r"^EPD sockets: (.*)$", srv.log(), re.MULTILINE)
    assert match, srv.log()
    return dict(item.split("=", 1) for item in match.group(1).split())


def worker_set(srv: ServerProcess) -> set[str]:
    return {re.search(r'worker="([^"]+)"', k).group(1) for k in srv.metrics()
            if k.startswith("epd:num_requests_running{")}


def group_processes(srv: ServerProcess) -> set[int]:
    out = subprocess.run(["ps", "-eo", "pid=,pgid=,stat="], capture_output=True, text=True).stdout
    return {int(pid) for pid, pgid, st_ in (line.split() for line in out.splitlines() if line.strip())
            if int(pgid) == srv.pgid and not st_.startswith("Z")}


def settled_zero(server, timeout_s: float) -> float:
    """Seconds until no worker runs or waits for anything and no KV block is in use."""
    started = time.monotonic()
    names = ("epd:num_requests_running", "epd:num_requests_waiting", "epd:kv_cache_usage_perc")
    while any(server.metric_sum(n) for n in names):
        if time.monotonic() - started > timeout_s:
            raise AssertionError({n: server.metric_sum(n) for n in names})
        time.sleep(0.1)
    return time.monotonic() - started
