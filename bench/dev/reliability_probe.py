"""`python -m bench.dev.reliability_probe MODEL_DIR`: issues 33's and 44's probes, re-run as one script.

Issue 44's reproductions live one area a module (reliability_probe_poison,
_tower, _video, _lora, _shutdown, _spec, _video_prompt), each starting its own
server; `ISSUE_44_CASES` lists them and `--issues 44` runs them alone.
What follows is issue 33's.

One `epd serve` (e-pd: an encoder and an aggregated prefill-decode worker)
with an API key, `--max-restarts 0` and a one-second `--shutdown-grace`,
started over an embedding-cache directory whose `data.mdb` is garbage, is
attacked the way the issue's probe did, from outside, over HTTP and signals:

  7   the corrupt cache: the server starts, the file is set aside
  1   two 50 MB bodies at once, a 100 MB chunked body, a JSON-item bomb:
      413s, the API's peak resident memory stays small, the server answers after
  10  /docs, /redoc, /openapi.json need the key; /metrics names no path or port
  9   /metrics shows each worker's cache (serving, set aside)
  5   the encoder killed past the restart limit: an image request is a 503 with
      Retry-After at once, text still served, the encoder's gauges gone
  6   SIGTERM past the grace under a stream and a plain request: a JSON 503 and
      an error event + [DONE], no traceback in the log

Then an external-worker deployment (`--external-workers`, CURVE keys, one
`epd worker`), attacked by a peer holding the worker keys:

  2-4 a Ready whose inbox is no address, a forged WorkerExited for the live
      worker, a forged Ready taking its id over to a rogue inbox, an Abort:
      the API keeps its worker, /health stays 200, requests are answered, the
      rogue inbox receives nothing
  8   `epd worker` runs with OMP_WAIT_POLICY=PASSIVE and the threads it was given
Each check prints PASS or FAIL with what it saw; the exit code is the
number of failures. Output: `<output-dir>/reliability_probe.json` and the log.
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from PIL import Image

from bench.dev.body_memory import _status_kib, make_body
from epd.bench.compare import ServeProcess, _free_port, cpu_set

KEY = "probe-key"
AUTH = {"authorization": f"Bearer {KEY}"}


class Probe:
    def __init__(self, out_dir: Path):
        self.rows: list[dict] = []
        self.out_dir = out_dir

    def check(self, item: str, what: str, ok: bool, saw) -> None:
        row = {"item": item, "check": what, "ok": bool(ok), "saw": saw}
        self.rows.append(row)
        print(f"{'PASS' if ok else 'FAIL'}  [{item}] {what}: {saw}", flush=True)


def _image_message(seed: int) -> list[dict]:
    buf = io.BytesIO()
    Image.new("RGB", (96, 64), (seed * 40 % 256, 90, 160)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is this?"}]}]


def _chat(base: str, model: str, messages, timeout_s: float = 60, **extra) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", headers=AUTH, timeout=timeout_s,
                      json={"model": model, "messages": messages, "max_tokens": 4, **extra})


def _chunks(body: bytes, size: int = 1 << 20):
    for i in range(0, len(body), size):
        yield body[i:i + size]


def probe_bodies(p: Probe, base: str, pid: int, model: str) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    before = _status_kib(pid, "VmRSS")
    big = make_body("text", 50_000_000, model)
    statuses: list = []

    def send() -> None:
        try:
            statuses.append(httpx.post(base + "/v1/chat/completions", content=big, timeout=120,
                                       headers={**AUTH, "content-type": "application/json"}).status_code)
        except httpx.HTTPError as exc:
            statuses.append(type(exc).__name__)
    threads = [threading.Thread(target=send) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    chunked = httpx.post(base + "/v1/chat/completions", content=_chunks(make_body("text", 100_000_000, model)),
                         timeout=120, headers={**AUTH, "content-type": "application/json"})
    bomb = httpx.post(base + "/v1/completions", timeout=60, headers={**AUTH, "content-type": "application/json"},
                      content=json.dumps({"model": model, "max_tokens": 1, "prompt": [1] * 3_000_000}).encode())
    peak_mib = (_status_kib(pid, "VmHWM") - before) / 1024
    # under the 64 MiB cap, the prompt is counted piece by piece and refused as too long
    p.check("1", "two 50 MB bodies at once: too long (400)", statuses == [400, 400], statuses)
    p.check("1", "a 100 MB chunked body", chunked.status_code == 413, chunked.status_code)
    p.check("1", "3 M JSON items in 9 MB", bomb.status_code == 413, bomb.status_code)
    bound_mib = 2 * (3 * 50e6 + 160e6) / 2**20  # docs/architecture.md: ~3x the body + 160 MB a request
    p.check("1", f"the API's peak RSS over its RSS before, MiB (bound {bound_mib:.0f})", peak_mib < bound_mib,
            round(peak_mib, 1))
    p.check("1", "answers after", _chat(base, model, [{"role": "user", "content": "hi"}]).status_code == 200, "")


def probe_edges(p: Probe, base: str, model_dir: str) -> None:
    codes = {path: httpx.get(base + path, timeout=10).status_code for path in ("/docs", "/redoc", "/openapi.json")}
    p.check("10", "docs need the key", set(codes.values()) == {401}, codes)
    metrics = httpx.get(base + "/metrics", timeout=10).text
    leaks = [s for s in (os.path.abspath(model_dir), "127.0.0.1:") if s in metrics]
    p.check("10", "/metrics names no path or address", not leaks, leaks)
    serving = _sum(metrics, "epd:mm_cache_serving")
    p.check("9", "every worker serves with its cache (epd:mm_cache_serving)", serving == 2, serving)
    p.check("7", "the corrupt file was set aside (epd:mm_cache_set_aside_total)",
            _sum(metrics, "epd:mm_cache_set_aside_total") == 1, _sum(metrics, "epd:mm_cache_set_aside_total"))


def _sum(metrics: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", metrics, re.M))


def probe_role_down(p: Probe, server: ServeProcess, model: str) -> None:
    found = re.search(r"EPD: worker encoder-0 pid (\d+)", server.log_path.read_text())
    if found is None:
        p.check("5", "the encoder's pid in the log", False, None)
        return
    os.kill(int(found.group(1)), signal.SIGKILL)
    deadline = time.monotonic() + 20
    while httpx.get(server.base_url + "/health", timeout=5).status_code != 503 and time.monotonic() < deadline:
        time.sleep(0.1)
    started = time.monotonic()
    refused = _chat(server.base_url, model, _image_message(1), timeout_s=120)
    seconds = time.monotonic() - started
    p.check("5", "an image request with the encoder down: 503 + Retry-After, at once",
            refused.status_code == 503 and "retry-after" in refused.headers and seconds < 5,
            {"status": refused.status_code, "retry_after": refused.headers.get("retry-after"),
             "seconds": round(seconds, 2)})
    text = _chat(server.base_url, model, [{"role": "user", "content": "hi"}])
    p.check("5", "text-only still served", text.status_code == 200, text.status_code)
    metrics = httpx.get(server.base_url + "/metrics", timeout=10).text
    stale = re.findall(r'^epd:encoder_queued_patches\{[^}]*\}', metrics, re.M)
    p.check("5", "the dead encoder's gauges left /metrics", not stale, stale)


def probe_shutdown(p: Probe, server: ServeProcess, model: str) -> None:
    results: dict = {}
    long = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}  # decoding for longer than the probe waits

    def stream() -> None:
        lines = []
        with httpx.stream("POST", server.base_url + "/v1/chat/completions", headers=AUTH, timeout=120,
                          json={"model": model, "messages": [{"role": "user", "content": "go"}], "stream": True,
                                **long}) as r:
            for line in r.iter_lines():
                lines.append(line)
        results["stream"] = lines

    def plain() -> None:
        r = _chat(server.base_url, model, [{"role": "user", "content": "go on"}], timeout_s=120, **long)
        results["plain"] = (r.status_code, r.headers.get("content-type", ""), r.text[:300])
    threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    time.sleep(3)  # both are decoding
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    server.proc.wait(60)
    lines = results.get("stream", [])
    events = [line for line in lines if line.startswith("data: ")]
    p.check("6", "the stream ends with an error event and [DONE]",
            len(events) >= 2 and '"error"' in events[-2] and events[-1] == "data: [DONE]", events[-2:])
    status, ctype, text = results.get("plain", (None, "", ""))
    p.check("6", "the plain request gets a JSON 503", status == 503 and "json" in ctype, (status, text[:120]))
    log = server.log_path.read_text()
    p.check("6", "no traceback in the log", "Traceback" not in log, log.count("Traceback"))


def probe_worker_plane(p: Probe, args, out: Path) -> None:
    # here, not at the top: `epd`'s parser imports this module, and the messages import torch
    # (which must load after `epd worker` set its OpenMP wait policy)
    from epd.transport.wire.auth import WORKER, PlaneKeys, make_keys
    from epd.transport.wire.channels import Receiver, Sender
    from epd.transport.wire.messages import Abort, Ready, WorkerExited

    shutil.rmtree(out / "keys", ignore_errors=True)
    keys_dir = make_keys(out / "keys")
    server = ServeProcess(args.model_dir, "aggregated", cpu_set(args.cpus),
                          ["--api-key", KEY, "--external-workers", "--worker-keys", str(keys_dir)],
                          out / "server-external.log")
    port = _free_port()
    with open(out / "worker.log", "w") as log:
        worker = subprocess.Popen([sys.executable, "-m", "epd.cli", "worker", args.model_dir, "--role", "aggregated",
                                   "--api", f"tcp://127.0.0.1:{server.port + 1}", "--host", "127.0.0.1",
                                   "--port", str(port), "--threads-per-worker", "1",
                                   "--worker-keys", str(keys_dir)], stdout=log, stderr=subprocess.STDOUT)
    keys = PlaneKeys.load(keys_dir, WORKER)
    forger = Sender(f"tcp://127.0.0.1:{server.port + 1}", keys=keys, server_key=keys.api_public)
    rogue = Receiver("tcp://127.0.0.1:*", keys=keys)
    try:
        model = server.wait_ready(300, headers=AUTH)
        said = re.findall(r"\d+ torch threads, OMP_WAIT_POLICY=\w+", (out / "worker.log").read_text())
        p.check("8", "epd worker: the threads it was given, OMP_WAIT_POLICY=PASSIVE (its start-up line)",
                said == ["1 torch threads, OMP_WAIT_POLICY=PASSIVE"], said)
        real_id = f"aggregated@{socket.gethostname()}:{port}"
        forger.send(Ready("decode-9", "decode", "not an address", "evil", None, "f" * 32))
        forger.send(WorkerExited(real_id, 9))
        forger.send(Ready(real_id, "aggregated", rogue.address, "evil", None, "f" * 32))
        forger.send(Abort(["chatcmpl-anything"]))
        time.sleep(2.0)
        health = httpx.get(server.base_url + "/health", timeout=10).status_code
        answers = [_chat(server.base_url, model, [{"role": "user", "content": f"hi {i}"}]).status_code
                   for i in range(5)]
        p.check("2-4", "after the forgeries /health is 200 and requests are answered",
                health == 200 and answers == [200] * 5, {"health": health, "answers": answers})
        p.check("2-4", "the rogue inbox received nothing", not rogue.poll(0.5), "")
        p.check("2-4", "the worker is alive", worker.poll() is None, worker.returncode)
    finally:
        forger.close()
        rogue.close()
        worker.send_signal(signal.SIGINT)
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
        server.stop()


# issue 44's reproductions, one module each (imported when run: they import this module's Probe):
# (item, module under bench.dev, function(p, model_dir, out))
ISSUE_44_CASES = (
    ("1", "reliability_probe_poison", "probe_poison"),
    ("1", "reliability_probe_tower", "probe_tower_attention"),
    ("1, 3", "reliability_probe_video", "probe_video_kwargs"),
    ("1", "reliability_probe_video", "probe_video_8k"),
    ("2, 4, 5, 8", "reliability_probe_lora", "probe_lora"),
    ("6", "reliability_probe_shutdown", "probe_group_sigterm"),
    ("8", "reliability_probe_spec", "probe_speculative_refusals"),
    ("7", "reliability_probe_video_prompt", "probe_video_prompt"),
)


def probe_issue_44(p: Probe, args, out: Path) -> None:
    """Each of issue 44's reproductions against its own server; one that breaks is a failed check."""
    import importlib

    for item, module_name, function in ISSUE_44_CASES:
        case_out = out / "issue-44" / function
        case_out.mkdir(parents=True, exist_ok=True)
        try:
            probe = getattr(importlib.import_module(f"bench.dev.{module_name}"), function)
            probe(p, args.model_dir, case_out)
        except Exception as exc:  # noqa: BLE001 - the probe reports what broke and goes on
            p.check(item, f"{function} ran to the end", False, f"{type(exc).__name__}: {exc}")


def main(args) -> int:
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    p = Probe(out)
    if "33" in args.issues:
        probe_issue_33(p, args, out)
    if "44" in args.issues:
        probe_issue_44(p, args, out)
    (out / "reliability_probe.json").write_text(json.dumps(p.rows, indent=2))
    failed = sum(not row["ok"] for row in p.rows)
    print(f"{len(p.rows) - failed} passed, {failed} failed", flush=True)
    return failed


def probe_issue_33(p: Probe, args, out: Path) -> None:
    cache = out / "mm-cache"
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(mode=0o700)
    (cache / "data.mdb").write_bytes(os.urandom(64 << 10))  # a damaged disk: the meta pages garbage
    server = ServeProcess(args.model_dir, "e-pd", cpu_set(args.cpus),
                          ["--api-key", KEY, "--mm-cache-dir", str(cache), "--max-restarts", "0",
                           "--down-retry-interval", "3600", "--shutdown-grace", "1"], out / "server.log")
    try:
        model = server.wait_ready(300, headers=AUTH)
        p.check("7", "starts over a corrupt cache", True, sorted(f.name for f in cache.glob("*.corrupt-*")))
        time.sleep(1.5)  # the workers' first stats
        probe_edges(p, server.base_url, args.model_dir)
        probe_bodies(p, server.base_url, server.proc.pid, model)
        probe_role_down(p, server, model)
        probe_shutdown(p, server, model)
    except Exception as exc:  # noqa: BLE001 - the probe reports what broke and stops
        p.check("-", "the probe ran to the end", False, f"{type(exc).__name__}: {exc}")
    finally:
        server.stop()
    try:
        probe_worker_plane(p, args, out)
    except Exception as exc:  # noqa: BLE001
        p.check("-", "the worker-plane probe ran to the end", False, f"{type(exc).__name__}: {exc}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", help="checkpoint directory to serve")
    p.add_argument("--cpus", default=None, help="CPU list the servers are pinned to (default: all)")
    p.add_argument("--output-dir", default="bench-results/reliability-probe")
    p.add_argument("--issues", default="33,44", help="whose reproductions to run: 33, 44 or 33,44 (default)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
