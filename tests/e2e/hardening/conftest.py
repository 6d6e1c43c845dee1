"""One real e-p-d server (tiny checkpoint) with every media and limit flag set,
plus one aggregated server on the defaults with an API key, shared by the
tests of this directory. Package-scoped (the `__init__.py` here makes the
directory a package): they stop once this directory's tests are done rather
than idle through the rest of the suite. A local HTTP server on 127.0.0.1
plays the remote image host (allowed), with slow, wrong, huge and
redirecting endpoints."""
from __future__ import annotations

import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from testkit.api_checks import (COMMON, HUGE_BODY_BYTES, IMAGE_MESSAGES, IMG, MAX_BODY_MB, MAX_IMAGE_BYTES,
                        MAX_IMAGE_PIXELS, MAX_MODEL_LEN, MAX_REQUEST_PIXELS, MAX_TOKENS, MAX_VIDEO_FRAMES, MAX_VIDEO_MB,
                        MODEL, TEXT_MESSAGES)
from testkit.hf_reference import hf_generate_text
from testkit.server import ServerProcess, free_port


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
            elif self.path in host.videos:  # tests/e2e/hardening/test_video_media.py
                self._send(200, "video/mp4", host.videos[self.path])
            elif self.path == "/redirect-clip":
                self._redirect("/clip.mp4")
            elif self.path == "/redirect-away-clip":
                self._redirect(f"http://localhost:{host.server_address[1]}/clip.mp4")
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


@pytest.fixture(scope="package")
def media_host():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _MediaHandler)
    httpd.daemon_threads = True
    httpd.huge_sent = 0
    httpd.videos = {}  # path -> bytes, filled by the video tests
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", httpd
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="package")
def media_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    (root / "allowed" / "img.png").write_bytes(IMG)
    (root / "outside.png").write_bytes(IMG)
    return root


@pytest.fixture(scope="package")
def server(tiny_model, tmp_path_factory, media_dir, media_host):
    port = free_port()
    args = ["serve", tiny_model, "--mode", "e-p-d", "--port", str(port), *COMMON, "--served-model-name", MODEL,
            "--allowed-media-domains", "127.0.0.1", "--media-fetch-timeout", "1",
            "--max-image-bytes", str(MAX_IMAGE_BYTES), "--max-image-pixels", str(MAX_IMAGE_PIXELS),
            "--limit-mm-per-prompt", "image=2", "--max-model-len", str(MAX_MODEL_LEN),
            "--max-request-pixels", str(MAX_REQUEST_PIXELS), "--max-request-body-mb", str(MAX_BODY_MB),
            "--allowed-local-media-path", str(media_dir / "allowed"),
            "--max-video-mb", str(MAX_VIDEO_MB), "--max-video-frames", str(MAX_VIDEO_FRAMES)]
    srv = ServerProcess(args, port, str(tmp_path_factory.mktemp("logs") / "server.log")).wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()
    assert not srv.group_alive()


@pytest.fixture(scope="package")
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


@pytest.fixture(scope="package")
def expected(tiny_model) -> dict[str, str]:
    return {"text": hf_generate_text(tiny_model, TEXT_MESSAGES, [], MAX_TOKENS),
            "image": hf_generate_text(tiny_model, IMAGE_MESSAGES, [IMG], MAX_TOKENS)}
