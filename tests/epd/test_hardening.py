"""`epd serve` against what clients and attackers send, through HTTP and ZeroMQ.

One real e-p-d server (tiny checkpoint) with every media and limit flag set,
plus one aggregated server on the defaults with an API key. Each bad input
must come back as a 4xx OpenAI error body, and the server must keep answering
good requests with transformers' greedy text. A local HTTP server on 127.0.0.1
plays the remote image host (allowed), with slow, wrong, huge and redirecting
endpoints.
"""
from __future__ import annotations

import asyncio
import io
import json
import os
import pickle
import re
import socket
import stat
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import msgpack
import openai
import pytest
import zmq
from hf_reference import hf_generate_text
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from media import data_url, image_bytes, image_part
from PIL import Image
from server import ServerProcess, free_port

from transport.messages import EncodeRequest, PrefillRequest

MODEL = "epd-hardened"
MAX_MODEL_LEN = 4000  # the tiny checkpoint's own limit is 4096
MAX_IMAGE_BYTES = 1_000_000
MAX_IMAGE_PIXELS = 4_000_000
MAX_TOKENS = 4
IMG = image_bytes(64, 48, seed=3)
TEXT_MESSAGES = [{"role": "user", "content": "Say something about boats."}]
IMAGE_MESSAGES = [{"role": "user", "content": [image_part(IMG), {"type": "text", "text": "Describe it."}]}]
HUGE_BODY_BYTES = 50 * 1024 * 1024
ERROR_KEYS = {"message", "type", "param", "code"}


# -- the remote image host -----------------------------------------------------------------------

class _MediaHandler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        host = self.server
        try:
            if self.path == "/img.png":
                self._send(200, "image/png", IMG)
            elif self.path == "/slow.png":
                time.sleep(3)  # longer than --media-fetch-timeout
                self._send(200, "image/png", IMG)
            elif self.path == "/text":
                self._send(200, "image/png", b"<html>this is not an image, whatever the header says</html>")
            elif self.path == "/missing.png":
                self._send(404, "text/plain", b"no such image")
            elif self.path == "/redirect-ok":
                self._redirect("/img.png")
            elif self.path == "/loop":
                self._redirect("/loop")
            elif self.path == "/redirect-away":  # same machine, but a host name that is not allowed
                self._redirect(f"http://localhost:{host.server_address[1]}/img.png")
            elif self.path == "/huge.png":  # no Content-Length: only counting bytes can stop it
                self.send_response(200)
                self.send_header("content-type", "image/png")
                self.end_headers()
                chunk = IMG + bytes(64 * 1024)
                while host.huge_sent < HUGE_BODY_BYTES:
                    self.wfile.write(chunk)
                    host.huge_sent += len(chunk)
            else:
                self._send(404, "text/plain", b"?")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the fetcher hung up: what it should do for slow and huge bodies

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("location", location)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def media_host():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _MediaHandler)
    httpd.daemon_threads = True
    httpd.huge_sent = 0
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", httpd
    httpd.shutdown()
    httpd.server_close()


# -- servers ---------------------------------------------------------------------------------------

COMMON = ["--num-kv-blocks", "512", "--dtype", "float32", "--device", "cpu", "--threads-per-worker", "1"]


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    (root / "allowed" / "img.png").write_bytes(IMG)
    (root / "outside.png").write_bytes(IMG)
    return root


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory, media_dir, media_host):
    port = free_port()
    args = ["serve", tiny_model, "--mode", "e-p-d", "--port", str(port), *COMMON, "--served-model-name", MODEL,
            "--allowed-media-domains", "127.0.0.1", "--media-fetch-timeout", "1",
            "--max-image-bytes", str(MAX_IMAGE_BYTES), "--max-image-pixels", str(MAX_IMAGE_PIXELS),
            "--limit-mm-per-prompt", "image=2", "--max-model-len", str(MAX_MODEL_LEN),
            "--allowed-local-media-path", str(media_dir / "allowed")]
    srv = ServerProcess(args, port, str(tmp_path_factory.mktemp("logs") / "server.log")).wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()
    assert not srv.group_alive()


@pytest.fixture(scope="module")
def plain_server(tiny_model, tmp_path_factory):
    """Defaults everywhere (no --host, no media flags); the API key from EPD_API_KEY."""
    port = free_port()
    os.environ["EPD_API_KEY"] = "sk-hardening"
    try:
        srv = ServerProcess(["serve", tiny_model, "--mode", "aggregated", "--port", str(port), *COMMON], port,
                            str(tmp_path_factory.mktemp("logs") / "plain.log"))
    finally:
        del os.environ["EPD_API_KEY"]
    srv.wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


def plain_server_model(srv) -> str:
    r = httpx.get(srv.base_url + "/v1/models", headers={"authorization": "Bearer sk-hardening"})
    return r.json()["data"][0]["id"]


@pytest.fixture(scope="module")
def expected(tiny_model) -> dict[str, str]:
    return {"text": hf_generate_text(tiny_model, TEXT_MESSAGES, [], MAX_TOKENS),
            "image": hf_generate_text(tiny_model, IMAGE_MESSAGES, [IMG], MAX_TOKENS)}


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


# -- every bad input is a 4xx with an OpenAI error body --------------------------------------------

def _messages_with(*parts) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}]


def _url_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _bomb() -> bytes:
    buf = io.BytesIO()
    Image.new("1", (20_000, 20_000)).save(buf, format="PNG")  # 400 megapixels in ~50 KB
    return buf.getvalue()


BAD_BODIES = {  # name -> (body, status, message, param)
    "schema_missing_messages": ({"model": MODEL}, 400, "field required", "messages"),
    "schema_wrong_type": (chat_body("hello"), 400, "", "messages"),
    "schema_max_tokens_string": (chat_body(TEXT_MESSAGES, max_tokens="many"), 400, "", "max_tokens"),
    "unknown_role": (chat_body([{"role": "wizard", "content": "hi"}]), 400, "unsupported role", "messages[0].role"),
    "role_not_a_string": (chat_body([{"role": ["user"], "content": "hi"}]), 400, "unsupported role",
                          "messages[0].role"),
    "temperature": (chat_body(TEXT_MESSAGES, temperature=7), 400, "", "temperature"),
    "top_p": (chat_body(TEXT_MESSAGES, top_p=0), 400, "", "top_p"),
    "n": (chat_body(TEXT_MESSAGES, n=0), 400, "", "n"),
    "presence_penalty": (chat_body(TEXT_MESSAGES, presence_penalty=3), 400, "", "presence_penalty"),
    "top_logprobs": (chat_body(TEXT_MESSAGES, logprobs=True, top_logprobs=99), 400, "", "top_logprobs"),
    "top_logprobs_without_logprobs": (chat_body(TEXT_MESSAGES, top_logprobs=2), 400, "requires logprobs", None),
    "min_tokens": (chat_body(TEXT_MESSAGES, min_tokens=9), 400, "min_tokens", "min_tokens"),
    "too_many_stops": (chat_body(TEXT_MESSAGES, stop=list("abcde")), 400, "stop", "stop"),
    "negative_seed_type": (chat_body(TEXT_MESSAGES, seed="x"), 400, "", "seed"),
    "too_long": (chat_body(TEXT_MESSAGES, max_tokens=MAX_MODEL_LEN), 400, "maximum context length", "max_tokens"),
    "unknown_model": ({**chat_body(TEXT_MESSAGES), "model": "gpt-17"}, 404, "does not exist", "model"),
}

BAD_MEDIA = {  # name -> (messages, message); all 400, param "messages"
    "bad_base64": (_messages_with(_url_part("data:image/png;base64,!!notbase64!!")), "invalid base64"),
    "not_an_image": (_messages_with(image_part(b"just some text, no picture")), "cannot identify image"),
    "truncated": (_messages_with(image_part(IMG[: len(IMG) // 2])), "could not be encoded"),
    "too_many_bytes": (_messages_with(image_part(image_bytes(600, 600, seed=9))), "exceeds the limit"),
    "too_many_images": (_messages_with(image_part(IMG), image_part(IMG), image_part(IMG)), "at most 2 images"),
    "unsupported_scheme": (_messages_with(_url_part("ftp://127.0.0.1/x.png")), "unsupported image url scheme"),
}


def test_malformed_json_is_400(server, expected):
    for content in (b'{"model": "epd-hardened", "messages": [', b"\xff\xfe garbage", b""):
        assert_error(post(server, content=content), 400)
    assert_error(post(server, content=b"[1, 2, 3]"), 400, "json object")
    assert_still_serving(server, expected)


@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_bad_request_body_is_refused(server, expected, name):
    body, status, message, param = BAD_BODIES[name]
    assert_error(post(server, body), status, message, param)
    assert_still_serving(server, expected)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("name", list(BAD_MEDIA))
def test_bad_image_is_refused_before_the_first_byte(server, expected, name, stream):
    """Streamed too: no 200 goes out before the image is known good, even for a
    truncated file only the encoder finds (EncodeDone(ok=False) -> prefill
    worker -> TokenOutput(error) -> RequestError)."""
    messages, message = BAD_MEDIA[name]
    assert_error(post(server, chat_body(messages), stream=stream), 400, message, "messages")
    assert_still_serving(server, expected, "image" if name == "truncated" else "text")


def test_decompression_bomb_is_refused_from_the_header(server, expected):
    started = time.monotonic()
    assert_error(post(server, chat_body(_messages_with(image_part(_bomb())))), 400,
                 f"exceeds the limit of {MAX_IMAGE_PIXELS} pixels", "messages")
    assert time.monotonic() - started < 5  # never decoded
    assert_still_serving(server, expected, "image")


def test_file_urls_only_under_the_allowed_path(server, expected, media_dir):
    good = (media_dir / "allowed" / "img.png").as_uri()
    assert answer_text(post(server, chat_body(_messages_with(_url_part(good))))) == \
        answer_text(post(server, chat_body(_messages_with(image_part(IMG)))))
    for url in ((media_dir / "outside.png").as_uri(), (media_dir / "allowed" / ".." / "outside.png").as_uri(),
                "file:///etc/passwd"):
        assert_error(post(server, chat_body(_messages_with(_url_part(url)))), 400, "outside the allowed", "messages")
    assert_error(post(server, chat_body(_messages_with(_url_part((media_dir / "allowed" / "nope.png").as_uri())))),
                 400, "cannot read", "messages")
    assert_still_serving(server, expected, "image")


# -- http(s) image URLs ----------------------------------------------------------------------------

def test_http_image_from_an_allowed_host(server, expected, media_host):
    base, _ = media_host
    reference = answer_text(post(server, chat_body(_messages_with(image_part(IMG)))))
    for path in ("/img.png", "/redirect-ok"):
        for stream in (False, True):
            assert answer_text(post(server, chat_body(_messages_with(_url_part(base + path))), stream=stream)) \
                == reference


@pytest.mark.parametrize("path, message", [
    ("/missing.png", "answered http 404"),
    ("/text", "cannot identify image"),  # the header check, whatever Content-Type says
    ("/huge.png", f"exceeds the limit of {MAX_IMAGE_BYTES} bytes"),
    ("/redirect-away", "'localhost' is not in --allowed-media-domains"),
    ("/loop", "redirected more than 5 times"),
    ("/slow.png", "timed out after 1 s"),
])
def test_bad_http_image_is_refused(server, expected, media_host, path, message):
    base, httpd = media_host
    started = time.monotonic()
    assert_error(post(server, chat_body(_messages_with(_url_part(base + path)))), 400, message, "messages")
    assert time.monotonic() - started < 2.5  # the timeout is 1 s; nothing waits for the slow host
    if path == "/huge.png":
        assert httpd.huge_sent < HUGE_BODY_BYTES / 2  # the fetcher stopped reading past the cap
    assert_still_serving(server, expected)


def test_disallowed_hosts_are_never_contacted(server, expected):
    for url in ("http://example.com/cat.png", "https://localhost/cat.png", "http://127.0.0.2/cat.png",
                "http://127.0.0.1@evil.example/cat.png"):
        assert_error(post(server, chat_body(_messages_with(_url_part(url)))), 400,
                     "is not in --allowed-media-domains", "messages")
    assert_still_serving(server, expected)


def test_defaults_refuse_http_and_file_urls(plain_server, media_host, media_dir):
    base, _ = media_host
    headers = {"authorization": "Bearer sk-hardening"}
    model = plain_server_model(plain_server)
    for url, message in ((base + "/img.png", "http(s) image urls are not allowed"),
                         ((media_dir / "allowed" / "img.png").as_uri(), "file:// image urls are not allowed")):
        body = {**chat_body(_messages_with(_url_part(url))), "model": model}
        assert_error(post(plain_server, body, headers=headers), 400, message, "messages")


# -- security --------------------------------------------------------------------------------------

def test_api_key_from_the_environment(plain_server):
    body = {**chat_body(TEXT_MESSAGES), "model": plain_server_model(plain_server)}
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "sk-hardening"},
                    {"authorization": "Basic sk-hardening"}):
        assert_error(post(plain_server, body, headers=headers), 401, "api key")
        assert_error(httpx.get(plain_server.base_url + "/v1/models", headers=headers), 401)
    c = openai.OpenAI(base_url=plain_server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        c.models.list()
    c = openai.OpenAI(base_url=plain_server.base_url + "/v1", api_key="sk-hardening", max_retries=0)
    assert c.chat.completions.create(**body).choices[0].message.content
    assert httpx.get(plain_server.base_url + "/health").status_code == 200  # probes need no key


def _listening_addresses(port: int) -> set[str]:
    """Local addresses a TCP socket LISTENs on at `port` (from /proc/net/tcp{,6})."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


def test_binds_loopback_by_default(plain_server):
    from epd.cli import build_parser
    from epd.config import ServeConfig

    assert ServeConfig.__dataclass_fields__["host"].default == "127.0.0.1"
    assert build_parser().parse_args(["serve", "ckpt"]).host == "127.0.0.1"
    if not os.path.exists("/proc/net/tcp"):
        pytest.skip("no /proc/net/tcp")
    assert _listening_addresses(plain_server.port) == {"0100007F"}  # 127.0.0.1, nothing else


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


def test_zmq_sockets_are_private_ipc(server):
    sockets = worker_sockets(server)
    assert set(sockets) == {"api", "encoder-0", "prefill-0", "decode-0"}
    for address in sockets.values():
        assert address.startswith("ipc://")
        run_dir = os.path.dirname(address[len("ipc://"):])
        assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700  # no other user can connect


def _garbage_frames(marker: Path) -> list[list[bytes]]:
    class Exploit:  # what a pickle-based wire would run on receipt
        def __reduce__(self):
            return (open, (str(marker), "w"))

    prefill = PrefillRequest("evil", [1, 2, 3], [], {}, [0], None, 0.0).to_wire()
    encode = EncodeRequest("evil", "ab" * 16, IMG, reply_to="ipc:///nowhere").to_wire()
    header = msgpack.unpackb(bytes(encode[0]))
    return [
        [b"\x00\xffnot msgpack at all"],
        [pickle.dumps(Exploit())],
        [msgpack.packb([1, 2, 3])],
        [msgpack.packb({"type": "no_such_type", "v": 1})],
        [msgpack.packb({"type": "abort", "v": 99, "request_ids": ["x"]})],
        [msgpack.packb({"type": "prefill_request", "v": 1})],  # fields missing
        [bytes(prefill[0])[: len(bytes(prefill[0])) // 2]],  # truncated header
        [bytes(encode[0]), bytes(encode[1])[:10]],  # truncated blob frame
        [bytes(encode[0])],  # blob frame missing
        [msgpack.packb({**header, "frames": [1 << 40]}), b"x"],  # absurd size
        [msgpack.packb({"type": "token_output", "v": 1, "request_id": 5, "token_ids": "no"})],
        [b"", b"", b""],
    ]


def test_garbage_frames_to_every_socket_harm_no_worker(server, expected, tmp_path):
    """No pickle on the wire: every socket gets garbage, truncated frames and a
    pickle that would write a file; every worker logs the drop and keeps serving."""
    sockets = worker_sockets(server)
    workers, pids = worker_set(server), group_processes(server)
    marker = tmp_path / "pwned"
    frames = _garbage_frames(marker)
    ctx = zmq.Context()
    try:
        for address in sockets.values():
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 5000)
            sock.connect(address)
            for msg in frames:
                sock.send_multipart(msg)
            sock.close()  # lingers until delivered
    finally:
        ctx.term()
    deadline = time.monotonic() + 10
    names = {name: ("collector" if name == "api" else name) for name in sockets}
    while time.monotonic() < deadline:
        log = server.log()
        if all(log.count(f"{n}: dropped a malformed message") >= len(frames) - 1 for n in names.values()):
            break
        time.sleep(0.2)
    for name in names.values():  # the empty-frames message may be read as one frame by some peers
        assert log.count(f"{name}: dropped a malformed message") >= len(frames) - 1, (name, log[-3000:])
    assert not marker.exists()
    assert_still_serving(server, expected, "image")
    assert worker_set(server) == workers and group_processes(server) == pids
    assert server.log().count("EPD ready") == 1
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_semantically_bad_wire_message_is_survived(server, expected):
    """Well-formed frames with contents no worker can use (unknown sampling field)."""
    sockets = worker_sockets(server)
    pids = group_processes(server)
    ctx = zmq.Context()
    try:
        for name, address in sockets.items():
            if name == "api":
                continue
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 5000)
            sock.connect(address)
            sock.send_multipart(PrefillRequest(f"bogus-{name}", [1, 2], [], {"no_such_field": 1}, [0], None,
                                               0.0).to_wire())
            sock.close()
    finally:
        ctx.term()
    time.sleep(0.5)
    assert_still_serving(server, expected)
    assert group_processes(server) == pids


# -- cancellation ----------------------------------------------------------------------------------

def _settled_zero(server, timeout_s: float) -> float:
    """Seconds until no worker runs or waits for anything and no KV block is in use."""
    started = time.monotonic()
    names = ("epd:num_requests_running", "epd:num_requests_waiting", "epd:kv_cache_usage_perc")
    while any(server.metric_sum(n) for n in names):
        if time.monotonic() - started > timeout_s:
            raise AssertionError({n: server.metric_sum(n) for n in names})
        time.sleep(0.1)
    return time.monotonic() - started


def _seconds_per_token(server) -> float:
    """The decode pace, from the inter-token latency of a 64-token request."""
    before = [server.metric_sum(f"epd:inter_token_latency_seconds_{k}") for k in ("sum", "count")]
    post(server, chat_body(TEXT_MESSAGES, max_tokens=64, ignore_eos=True, stream=True))
    after = [server.metric_sum(f"epd:inter_token_latency_seconds_{k}") for k in ("sum", "count")]
    return (after[0] - before[0]) / (after[1] - before[1])


LONG = {"max_tokens": MAX_MODEL_LEN - 300, "ignore_eos": True}  # room for two images in the prompt


def test_disconnect_mid_stream_aborts_in_every_worker(server, expected):
    _settled_zero(server, 10)
    still_to_run_s = _seconds_per_token(server) * (LONG["max_tokens"] - 30)
    body = chat_body(TEXT_MESSAGES, stream=True, **LONG)
    with httpx.Client(timeout=60) as client, client.stream("POST", server.base_url + "/v1/chat/completions",
                                                           json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        num_chunks = 0
        while num_chunks < 30:
            num_chunks += next(lines).startswith("data: {")
        deadline = time.monotonic() + 5
        while server.metric_sum("epd:kv_cache_usage_perc", role="decode") == 0:  # it runs on decode now
            assert time.monotonic() < deadline
            time.sleep(0.05)
    freed_after_s = _settled_zero(server, 10)
    assert freed_after_s < 0.5 * still_to_run_s, "not aborted: it ran on"
    assert_still_serving(server, expected)


def test_disconnect_while_images_encode_frees_everything(server, expected):
    """Gone as soon as the API sent the images to the encoder (typically before
    the first byte): the encoder's queue, the prefill worker's pending request
    and every block are freed."""
    _settled_zero(server, 10)
    would_run_s = _seconds_per_token(server) * LONG["max_tokens"]
    images = [image_bytes(256, 256, seed=900 + i) for i in range(2)]
    payload = json.dumps(chat_body(_messages_with(*map(image_part, images)), stream=True, **LONG)).encode()
    queried = server.metric_sum("epd:mm_cache_queries_total")
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: epd\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % len(payload) + payload)
        deadline = time.monotonic() + 10
        while server.metric_sum("epd:mm_cache_queries_total") < queried + 2:  # EncodeRequests are leaving
            assert time.monotonic() < deadline
    assert _settled_zero(server, 10) < 0.5 * would_run_s, "not aborted: it ran on"
    assert_still_serving(server, expected, "image")


# -- metrics ---------------------------------------------------------------------------------------

VLLM_NAMES = [
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
    "prefix_cache_hits_total", "mm_cache_queries_total", "mm_cache_hits_total", "prompt_tokens_total",
    "generation_tokens_total", "request_success_total", "num_preemptions_total",
    "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
    "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket",
    "encoder_queue_time_seconds_sum", "encode_seconds_sum", "kv_transfer_seconds_sum", "kv_transfer_bytes_total",
]


def test_vllm_metric_names(server, expected):
    queued = server.metric_sum("epd:request_queue_time_seconds_count")
    assert_still_serving(server, expected, "image")
    names = {key.split("{", 1)[0] for key in server.metrics()}
    assert [n for n in VLLM_NAMES if f"epd:{n}" not in names] == []
    assert server.metric_sum("epd:request_success_total", finished_reason="length") >= 1
    assert server.metric_sum("epd:request_queue_time_seconds_count") == queued + 1
    assert server.metric_sum("epd:kv_transfer_bytes_total", role="decode") > 0
    assert server.settled_sum("epd:encode_seconds_count", role="encoder") >= 1


# -- fuzzing the schema ----------------------------------------------------------------------------

JUNK = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=12),
                 st.lists(st.integers(-3, 3), max_size=3),
                 st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))


def mostly(valid, junk=JUNK, one_in: int = 6):
    """`valid`, or one time in `one_in` junk of any JSON type."""
    return st.sampled_from([True] * (one_in - 1) + [False]).flatmap(lambda ok: valid if ok else junk)


def _mutate(drawn) -> dict:
    """A valid body with up to two fields set to junk and maybe one dropped;
    never unbounded (no max_tokens at all would run to the model length)."""
    body, junk, dropped = drawn
    body = {**body, **dict(junk)}
    for name in dropped:
        body.pop(name, None)
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 1
    return body


def _fuzz_body(media_base: str):
    """Near-valid chat bodies, so the fuzz reaches past the schema into media and sampling."""
    urls = st.sampled_from([data_url(IMG), data_url(IMG[:40]), data_url(b"text"), "data:image/png;base64,%%%",
                            "data:,", f"{media_base}/img.png", f"{media_base}/text", f"{media_base}/missing.png",
                            "http://example.com/a.png", "file:///etc/passwd", "", "javascript:alert(1)"])
    part = mostly(st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": mostly(st.text(max_size=20))}),
        st.fixed_dictionaries({"type": st.just("image_url"),
                               "image_url": mostly(st.fixed_dictionaries({"url": urls}))}),
        st.fixed_dictionaries({"type": st.sampled_from(["image", "input_audio", "video_url", ""])})))
    message = st.fixed_dictionaries(
        {"role": mostly(st.sampled_from(["user", "user", "user", "system", "assistant", "developer", "tool"])),
         "content": mostly(st.text(max_size=30) | st.lists(part, min_size=1, max_size=3))},
        optional={"name": st.text(max_size=5)})
    small = st.integers(1, MAX_TOKENS)  # a good request stays short
    stop = st.text(min_size=1, max_size=3)
    fields = st.fixed_dictionaries(
        {"model": st.just(MODEL), "messages": st.lists(message, min_size=1, max_size=3), "max_tokens": small},
        optional={"max_completion_tokens": small, "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
                  "top_k": st.integers(-1, 50), "min_p": st.floats(0, 1), "n": st.integers(1, 3),
                  "seed": st.integers(-(2**63), 2**63 - 1), "stop": stop | st.lists(stop, max_size=4),
                  "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
                  "repetition_penalty": st.floats(0.5, 2), "min_tokens": st.integers(0, 1),
                  "stop_token_ids": st.lists(st.integers(0, 200), max_size=3),
                  "ignore_eos": st.booleans(), "logit_bias": st.just({}), "response_format": st.just({"type": "text"}),
                  "tools": st.none(), "tool_choice": st.sampled_from([None, "none"]),
                  "skip_special_tokens": st.booleans(), "add_generation_prompt": st.booleans(),
                  "user": st.text(max_size=5)})
    names = st.sampled_from(["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                             "top_k", "min_p", "n", "seed", "stop", "presence_penalty", "frequency_penalty",
                             "logprobs", "top_logprobs", "stream", "stream_options", "min_tokens",
                             "stop_token_ids", "logit_bias", "response_format", "tools", "tool_choice"])
    usage = st.fixed_dictionaries({"include_usage": st.booleans()})
    streams = st.one_of(st.just({}), st.fixed_dictionaries({"stream": st.booleans()}),
                        st.fixed_dictionaries({"stream": st.just(True)}, optional={"stream_options": usage}))
    logprobs = st.one_of(st.just({}), st.fixed_dictionaries({"logprobs": st.booleans()}), st.fixed_dictionaries(
        {"logprobs": st.just(True), "top_logprobs": st.integers(0, 20)}))
    valid = st.tuples(fields, streams, logprobs).map(lambda dicts: {k: v for d in dicts for k, v in d.items()})
    return st.tuples(valid, st.lists(st.tuples(names, JUNK), max_size=2), st.lists(names, max_size=1)).map(_mutate)


def test_fuzzed_chat_bodies_never_get_a_5xx(server, expected, media_host):
    statuses = []

    @settings(max_examples=150, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=_fuzz_body(media_host[0]))
    def check(body):
        content = json.dumps(body).encode()  # NaN and Infinity included, as Python's json reads them
        response = post(server, content=content)
        statuses.append(response.status_code)
        assert response.status_code < 500, (body, response.text)
        assert "server_error" not in response.text, (body, response.text)
        if response.status_code != 200:
            assert set(response.json()["error"]) == ERROR_KEYS

    check()
    assert 200 in statuses and any(400 <= s < 500 for s in statuses)  # both sides were explored
    assert_still_serving(server, expected, "image")


# -- load mixed with bad requests ------------------------------------------------------------------

def test_200_concurrent_requests_mixed_with_bad_ones(server, expected):
    good = {"text": chat_body(TEXT_MESSAGES), "image": chat_body(IMAGE_MESSAGES)}
    for i in range(3):
        good[f"short-{i}"] = chat_body([{"role": "user", "content": f"Number {i} is the best, isn't it?"}])
    reference = {name: answer_text(post(server, body)) for name, body in good.items()}
    assert reference["text"] == expected["text"] and reference["image"] == expected["image"]
    bad = [(b"{not json", 400), (json.dumps(chat_body(_messages_with(image_part(b"GIF89a?")))).encode(), 400),
           (json.dumps(chat_body(BAD_MEDIA["bad_base64"][0])).encode(), 400),
           (json.dumps({**chat_body(TEXT_MESSAGES), "model": "nope"}).encode(), 404),
           (json.dumps(chat_body(TEXT_MESSAGES, temperature=-1)).encode(), 400),
           (json.dumps(chat_body(TEXT_MESSAGES, max_tokens=MAX_MODEL_LEN)).encode(), 400),
           (json.dumps(chat_body(_messages_with(_url_part("http://example.com/x.png")))).encode(), 400)]
    names = list(good)
    jobs = [("good", names[i % len(names)], i % 2 == 1) for i in range(150)] + \
           [("bad", i % len(bad), i % 2 == 1) for i in range(50)]
    jobs = [jobs[(i * 37) % len(jobs)] for i in range(len(jobs))]  # interleaved (37 is coprime to 200)
    workers, pids = worker_set(server), group_processes(server)

    async def run_all():
        limits = httpx.Limits(max_connections=len(jobs))
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60, limits=limits) as client:
            async def one(kind, key, stream):
                headers = {"content-type": "application/json"}
                if kind == "good":
                    body = {**good[key], "stream": stream}
                    return await client.post("/v1/chat/completions", json=body, headers=headers)
                content, _ = bad[key]
                return await client.post("/v1/chat/completions", content=content, headers=headers)
            return await asyncio.gather(*(one(*job) for job in jobs))

    responses = asyncio.run(run_all())
    for (kind, key, _), response in zip(jobs, responses):
        if kind == "good":
            assert answer_text(response) == reference[key]
        else:
            assert_error(response, bad[key][1])
    assert worker_set(server) == workers and group_processes(server) == pids
    assert server.log().count("EPD ready") == 1
    _settled_zero(server, 10)


def test_many_requests_with_one_broken_image_all_fail(server, expected):
    """Only the encoder finds this image broken, for 40 requests at once, while
    80 good ones keep the prefill worker busy (its inbox fills from both pipes)."""
    broken = chat_body(_messages_with(image_part(IMG[:301])))
    bodies = [broken if i % 3 == 0 else chat_body(TEXT_MESSAGES, max_tokens=16) for i in range(120)]

    async def run_all():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=10,
                                     limits=httpx.Limits(max_connections=len(bodies))) as client:
            return await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies),
                                        return_exceptions=True)

    responses = asyncio.run(run_all())
    hung = sum(isinstance(r, httpx.TimeoutException) for r in responses)
    assert hung == 0, f"{hung} of {len(bodies)} requests never answered"
    for body, response in zip(bodies, responses):
        if body is broken:
            assert_error(response, 400, "could not be encoded", "messages")
        else:
            assert response.status_code == 200
    _settled_zero(server, 10)
    assert_still_serving(server, expected, "image")
