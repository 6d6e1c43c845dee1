"""Issue 44, item 6, as a reliability-probe case: SIGTERM to the whole process group
of `epd serve` (systemd's KillMode=control-group, a terminal's job control), past
`--shutdown-grace`, while a stream and a plain request decode, with one API process
and with two. Each must end as SIGTERM to the API alone ends it: a JSON 503 for the
plain request, an error event and `data: [DONE]` for the stream, exit code 0, no
traceback, no process of the group left. Recorded per case: the answers, the
seconds from the signal to the launcher's exit, the processes left.

`probe_group_sigterm(p, model_dir, out)` starts and stops its own servers (bounded
waits); `python -m bench.dev.reliability_probe` (bench/dev/reliability_probe.py) runs it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from bench.dev.reliability_probe import AUTH, KEY, Probe
from epd.bench.compare import ServeProcess, cpu_set

GRACE_S = 1
LONG = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}  # decoding for longer than the probe waits


def probe_group_sigterm(p: Probe, model_dir: str, out: Path) -> None:
    for api_servers in (1, 2):
        flags = ["--api-key", KEY, "--shutdown-grace", str(GRACE_S), "--api-servers", str(api_servers)]
        server = ServeProcess(model_dir, "e-pd", cpu_set(None), flags,
                              out / f"server-group-sigterm-{api_servers}.log", new_session=True)
        try:
            _one_case(p, server, api_servers)
        finally:
            _kill_group(server.proc.pid)
            server.stop()


def _one_case(p: Probe, server: ServeProcess, api_servers: int) -> None:
    model = server.wait_ready(300, headers=AUTH)
    results: dict = {}
    body = {"model": model, "messages": [{"role": "user", "content": "go"}], **LONG}

    def stream() -> None:
        lines = []
        try:
            with httpx.stream("POST", server.base_url + "/v1/chat/completions", headers=AUTH, timeout=120,
                              json={**body, "stream": True}) as r:
                for line in r.iter_lines():
                    lines.append(line)
        except httpx.HTTPError as exc:
            lines.append(f"(cut: {type(exc).__name__})")
        results["stream"] = lines

    def plain() -> None:
        try:
            r = httpx.post(server.base_url + "/v1/chat/completions", headers=AUTH, timeout=120, json=body)
            results["plain"] = (r.status_code, r.headers.get("content-type", ""), r.text[:200])
        except httpx.HTTPError as exc:
            results["plain"] = (None, "", f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    time.sleep(3)  # both are decoding
    signalled = time.monotonic()
    os.killpg(server.proc.pid, signal.SIGTERM)
    for t in threads:
        t.join(60)
    try:
        code = server.proc.wait(60)
    except subprocess.TimeoutExpired:
        code = None
    exit_s = round(time.monotonic() - signalled, 1)
    left = _group_members(server.proc.pid, grace_s=30)
    case = f"6 (group SIGTERM, {api_servers} API process{'es' if api_servers > 1 else ''})"
    events = [line for line in results.get("stream", []) if line.startswith("data: ")]
    p.check(case, "the stream ends with an error event and [DONE]",
            len(events) >= 2 and '"error"' in events[-2] and events[-1] == "data: [DONE]",
            [e[:120] for e in events[-2:]] + results.get("stream", [])[-1:])
    status, ctype, text = results.get("plain", (None, "", ""))
    p.check(case, "the plain request gets a JSON 503", status == 503 and "json" in ctype, (status, text[:120]))
    p.check(case, "the launcher exits 0", code == 0, {"exit_code": code, "seconds_after_sigterm": exit_s})
    p.check(case, "no process of the group is left", not left, left)
    log = server.log_path.read_text()
    p.check(case, "no traceback in the log", "Traceback" not in log, log.count("Traceback"))


def _group_members(pgid: int, grace_s: float) -> list[str]:
    """The live (not zombie) processes of group `pgid`, `grace_s` after the launcher exited (none: [])."""
    deadline = time.monotonic() + grace_s
    while True:
        ps = subprocess.run(["ps", "-eo", "pid=,pgid=,stat=,comm="], capture_output=True, text=True).stdout
        rows = [line.split(None, 3) for line in ps.splitlines() if line.strip()]
        live = [f"{pid} {comm}" for pid, group, stat, comm in rows if int(group) == pgid and not stat.startswith("Z")]
        if not live or time.monotonic() > deadline:
            return live
        time.sleep(0.2)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":  # python -m bench.dev.reliability_probe_shutdown MODEL_DIR OUT_DIR
    probe = Probe(Path(sys.argv[2]))
    Path(sys.argv[2]).mkdir(parents=True, exist_ok=True)
    probe_group_sigterm(probe, sys.argv[1], Path(sys.argv[2]))
    sys.exit(sum(not row["ok"] for row in probe.rows))
