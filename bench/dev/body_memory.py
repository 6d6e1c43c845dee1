"""`python -m bench.dev.body_memory`: what one large request body costs the API process.

Starts `epd serve` (aggregated, one worker: the API process is the one
measured) for each of `--kinds` and `--sizes-mb` and sends it one body:

  text      a chat message whose text is the whole body ("lorem ipsum ..."):
            JSON parsing, the chat template and the tokenizer see all of it
  ids       a completion whose prompt is a list of token ids filling the body:
            JSON parsing turns every 2-3 bytes into a Python int
  messages  a chat of many one-word messages filling the body: a dict and two
            strings for every ~40 bytes

For each it reports the HTTP status, the seconds to the answer, and the API
process's peak resident memory while it was served, over its resident memory
before (Linux's VmHWM, reset through /proc/PID/clear_refs before the body),
and whether the server still answers a small request after it. It talks to
the server over HTTP only.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx

from epd.bench.compare import ServeProcess, cpu_set

KINDS = ("text", "ids", "messages")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", help="checkpoint directory to serve")
    p.add_argument("--sizes-mb", default="1,10,100", help="body sizes in MB (10^6 bytes), comma-separated")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"body kinds among {', '.join(KINDS)}")
    p.add_argument("--cpus", default=None, help="CPU list the server is pinned to (default: all)")
    p.add_argument("--server-args", default="", help="extra `epd serve` flags")
    p.add_argument("--timeout-s", type=float, default=600.0, help="give up on one body after this long")
    p.add_argument("--output-dir", default="bench-results")


def make_body(kind: str, num_bytes: int, model: str) -> bytes:
    """A JSON request body of about `num_bytes` bytes."""
    if kind == "text":
        words = "lorem ipsum dolor sit amet " * (num_bytes // 27 + 1)
        return json.dumps({"model": model, "max_tokens": 1,
                           "messages": [{"role": "user", "content": words[:num_bytes]}]}).encode()
    if kind == "ids":
        return json.dumps({"model": model, "max_tokens": 1, "prompt": [7] * (num_bytes // 3)}).encode()
    if kind == "messages":
        message = {"role": "user", "content": "hi"}
        return json.dumps({"model": model, "max_tokens": 1, "messages": [message] * (num_bytes // 33)}).encode()
    raise ValueError(f"unknown body kind {kind!r}; expected one of {', '.join(KINDS)}")


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def send_body(base_url: str, pid: int, kind: str, body: bytes, timeout_s: float) -> dict:
    """One body, alone: status, seconds, and the API's peak RSS above its RSS before (MiB)."""
    path = "/v1/completions" if kind == "ids" else "/v1/chat/completions"
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
    before_kib = _status_kib(pid, "VmRSS")
    started = time.monotonic()
    try:
        response = httpx.post(base_url + path, content=body, timeout=timeout_s,
                              headers={"content-type": "application/json"})
        status, error = response.status_code, _error_message(response)
    except httpx.HTTPError as exc:
        status, error = None, f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - started
    try:
        peak_kib = _status_kib(pid, "VmHWM")
    except FileNotFoundError:  # the API process is gone
        peak_kib = None
    return {"kind": kind, "body_mb": round(len(body) / 1e6, 1), "status": status, "seconds": round(seconds, 2),
            "peak_rss_over_mib": None if peak_kib is None else round((peak_kib - before_kib) / 1024, 1),
            "error": error}


def _error_message(response: httpx.Response) -> str | None:
    if response.status_code == 200:
        return None
    try:
        return response.json()["error"]["message"][:160]
    except (ValueError, KeyError, TypeError):
        return response.text[:160]


def main(args) -> dict:
    """Each body on a server of its own: memory a previous body freed would hide the next one's peak."""
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    kinds = [k for k in args.kinds.split(",") if k]
    sizes = [float(s) for s in args.sizes_mb.split(",") if s]
    rows = []
    for kind in kinds:
        for size_mb in sizes:
            server = ServeProcess(args.model_dir, "aggregated", cpu_set(args.cpus), args.server_args.split(),
                                  out_dir / f"server_{kind}_{size_mb:g}.log")
            try:
                model = server.wait_ready()
                row = send_body(server.base_url, server.proc.pid, kind, make_body(kind, int(size_mb * 1e6), model),
                                args.timeout_s)
                row["server_answers_after"] = _answers(server.base_url, model) if server.proc.poll() is None \
                    else False
            finally:
                server.stop()
            rows.append(row)
            print(json.dumps(row), flush=True)
    (out_dir / "body_memory.json").write_text(json.dumps(rows, indent=2))
    return {"rows": rows}


def _answers(base_url: str, model: str) -> bool:
    """Whether the server answers a small request after the body."""
    try:
        return httpx.post(base_url + "/v1/chat/completions", timeout=60, json={
            "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]}).status_code == 200
    except httpx.HTTPError:
        return False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.dev.body_memory", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return parser


if __name__ == "__main__":
    main(build_parser().parse_args())
