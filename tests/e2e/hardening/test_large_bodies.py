"""One large request must never take the API down (issue 33, item 1): a body
past --max-request-body-mb is a 413 before it is read, a body of half a million
tiny JSON items is refused before it is parsed, and a prompt of megabytes is
refused after tokenizing a piece of it. Each is checked on the real server
(its API process's peak memory read from /proc), which then still answers
with transformers' text."""
from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from testkit.api_checks import MAX_BODY_MB, MAX_MODEL_LEN, MODEL, assert_error, assert_still_serving, chat_body, post

MAX_BODY_BYTES = int(MAX_BODY_MB * (1 << 20))
# What the API process may grow by while refusing one body. Before the bounds, a
# 3 MB text prompt cost ~800 MB (the tokenizer holds ~270 bytes a character).
MAX_GROWTH_MIB = 120


def _rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for pid {pid}")


class _PeakGrowth:
    """The API process's peak RSS over its RSS at the start of the block (MiB)."""

    def __init__(self, server):
        self.pid = server.proc.pid  # the launcher is the API process (one --api-servers)

    def __enter__(self):
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
        self.before_kib = _rss_kib(self.pid, "VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        self.mib = (_rss_kib(self.pid, "VmHWM") - self.before_kib) / 1024


def _text_body(num_bytes: int, path: str = "chat") -> dict:
    words = ("lorem ipsum dolor sit amet " * (num_bytes // 27 + 1))[:num_bytes]
    if path == "chat":
        return chat_body([{"role": "user", "content": words}])
    return {"model": MODEL, "prompt": words, "max_tokens": 1}


def test_a_body_past_the_cap_is_413_and_the_server_keeps_serving(server, expected):
    body = json.dumps(_text_body(MAX_BODY_BYTES + 1)).encode()
    with _PeakGrowth(server) as growth:
        response = post(server, content=body)
    error = assert_error(response, 413, "larger than")
    assert error["code"] == "request_too_large"
    assert response.headers["connection"] == "close"
    assert growth.mib < MAX_GROWTH_MIB
    assert_still_serving(server, expected)


def test_a_chunked_body_is_cut_off_at_the_cap(server, expected):
    """No Content-Length: the bytes read are counted, nothing past the cap is kept."""
    chunk = b" " * (1 << 16)
    num_chunks = 8 * MAX_BODY_BYTES // len(chunk)  # 8x the cap, read and thrown away

    def body():
        yield b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "'
        for _ in range(num_chunks):
            yield chunk

    with _PeakGrowth(server) as growth:
        response = post(server, content=body())
    assert "content-length" not in response.request.headers
    assert_error(response, 413, "larger than")
    assert growth.mib < MAX_GROWTH_MIB
    assert_still_serving(server, expected)


def test_expect_100_continue_gets_the_413_before_any_body(server, expected):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     f"content-length: {10 * MAX_BODY_BYTES}\r\nexpect: 100-continue\r\n\r\n".encode())
        reply = b""
        while b"\r\n\r\n" not in reply:
            data = sock.recv(65536)
            assert data, reply
            reply += data
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]  # no "100 Continue": the body was never asked for
    assert_still_serving(server, expected)


@pytest.mark.parametrize("path", ["chat", "completions"])
def test_a_prompt_of_megabytes_is_refused_after_a_piece_is_tokenized(server, expected, path):
    body = _text_body(3_000_000, path)
    with _PeakGrowth(server) as growth:
        response = post(server, body, path="/v1/chat/completions" if path == "chat" else "/v1/completions")
    error = assert_error(response, 400, "maximum context length", "messages" if path == "chat" else "prompt")
    assert f"more than {MAX_MODEL_LEN - 1} tokens" in error["message"]
    assert growth.mib < MAX_GROWTH_MIB  # ~800 MB when the whole prompt was tokenized
    assert_still_serving(server, expected)


@pytest.mark.parametrize("kind", ["token_ids", "messages"])
def test_half_a_million_json_items_are_refused_before_parsing(server, expected, kind):
    if kind == "token_ids":
        body = {"model": MODEL, "prompt": [1] * (1 << 19), "max_tokens": 1}
    else:
        body = chat_body([{}] * (1 << 19))  # "{}," each: under the byte cap, ~100 bytes apiece once parsed
    content = json.dumps(body, separators=(",", ":")).encode()
    assert len(content) < MAX_BODY_BYTES
    with _PeakGrowth(server) as growth:
        response = post(server, content=content, path="/v1/completions" if kind == "token_ids" else
                        "/v1/chat/completions")
    error = assert_error(response, 413, "JSON items")
    assert error["code"] == "request_too_large"
    assert growth.mib < MAX_GROWTH_MIB
    assert_still_serving(server, expected)
