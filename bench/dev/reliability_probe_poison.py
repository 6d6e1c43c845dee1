"""Issue 44, item 1's reproduction for `python -m bench.dev.reliability_probe`: a poison request.

One `epd serve` (e-pd) whose encoder is given the test fault
`EPD_TEST_ENCODER_CRASH_IMAGE` (tests/testkit/encoder_delays.py, reached through
the checkout's tests/testkit/delay_site on the server's PYTHONPATH): a batch holding an
image of POISON_SIZE SIGKILLs the encoder CRASH_AFTER_S into it, as the OOM
killer ended the encoder under the issue's 8K video. The poison request is
sent, and while the encoder is in it another user's image request: the poison
gets its error after one death (it used to be sent into each restarted encoder:
4 deaths, then a 503 after 215 s, the other user waiting 97.8 s), the other is
answered after one restart, /health is 200 again, nothing sends the poison to
the restarted encoder. Recorded: statuses, seconds, encoder deaths, the API's
peak RSS.
"""
from __future__ import annotations

import base64
import io
import os
import re
import sys
import threading
import time
from pathlib import Path

import httpx
from PIL import Image

from bench.dev.body_memory import _status_kib
from epd.bench.compare import ServeProcess, cpu_set

POISON_SIZE = (72, 40)
CRASH_AFTER_S = 3.0
REQUEST_TIMEOUT_S = 240
CRASH_LOG = "test fault: this batch kills the encoder"  # tests/testkit/encoder_delays.py CRASH_LOG


class _FaultyServer(ServeProcess):
    """`epd serve` e-pd with the encoder's crash fault in its environment."""

    def __init__(self, model_dir: str, log_path: Path):
        site = next(str(p / "tests/testkit/delay_site") for p in Path(__file__).resolve().parents
                    if (p / "tests/testkit/delay_site").is_dir())  # the test fault lives in the checkout's tests
        env = {**os.environ, "EPD_TEST_ENCODER_CRASH_IMAGE": f"{POISON_SIZE[0]}x{POISON_SIZE[1]}:{CRASH_AFTER_S}",
               "PYTHONPATH": os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))}
        self._launch(lambda port: [sys.executable, "-m", "epd.cli", "serve", model_dir, "--mode", "e-pd",
                                   "--port", str(port), "--request-timeout", str(REQUEST_TIMEOUT_S)],
                     cpu_set(None), log_path, env)


def _image_chat(base: str, model: str, size: tuple[int, int], shade: int) -> tuple[int | str, float, str]:
    """(status, seconds, error code or '') of one image chat."""
    buf = io.BytesIO()
    Image.new("RGB", size, (shade, 90, 160)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}]}]}
    start = time.monotonic()
    try:
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S + 30)
    except httpx.HTTPError as exc:
        return type(exc).__name__, time.monotonic() - start, ""
    code = r.json().get("error", {}).get("code") or "" if r.status_code != 200 else ""
    return r.status_code, round(time.monotonic() - start, 1), code


def _metric(base: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def probe_poison(p, model_dir: str, out: Path) -> None:
    """Item 44.1: a request whose image kills its encoder fails after one death; another user's
    image queued behind it is answered; nothing re-sends the poison. `p`: the probe's `Probe`."""
    log_path = out / "server-poison.log"
    server = _FaultyServer(model_dir, log_path)
    try:
        model = server.wait_ready(300)
        results: dict[str, tuple] = {}
        poison = threading.Thread(target=lambda: results.update(
            poison=_image_chat(server.base_url, model, POISON_SIZE, 200)), daemon=True)
        poison.start()
        in_batch = _wait(lambda: CRASH_LOG in log_path.read_text(), 60)
        other = threading.Thread(target=lambda: results.update(
            other=_image_chat(server.base_url, model, (96, 64), 30)), daemon=True)
        other.start()
        poison.join(REQUEST_TIMEOUT_S + 60)
        other.join(REQUEST_TIMEOUT_S + 60)
        status, seconds, code = results.get("poison", ("hung", None, ""))
        p.check("44.1", "the poison request fails with a 400 input_crashed_worker", in_batch and status == 400
                and code == "input_crashed_worker", {"status": status, "seconds": seconds, "code": code})
        status, seconds, _ = results.get("other", ("hung", None, ""))
        p.check("44.1", "another user's image, queued behind it, is answered", status == 200,
                {"status": status, "seconds": seconds})
        back = _wait(lambda: httpx.get(server.base_url + "/health", timeout=5).status_code == 200, 300)
        deaths = _metric(server.base_url, "epd:worker_restarts_total", role="encoder")
        p.check("44.1", "one encoder death, /health 200 after its restart", back and deaths == 1,
                {"encoder_restarts": deaths, "health_200": back,
                 "failed_as_poison": _metric(server.base_url, "epd:requests_failed_total", reason="poison")})
        text = log_path.read_text()
        p.check("44.1", "nothing sent the poison to the restarted encoder", text.count(CRASH_LOG) == 1,
                {"crashes_logged": text.count(CRASH_LOG),
                 "encoder_processes": len(re.findall(r"EPD: worker encoder-0 pid", text)),
                 "api_peak_rss_mib": round(_status_kib(server.proc.pid, "VmHWM") / 1024, 1)})
    finally:
        server.stop()
