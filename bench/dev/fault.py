"""`python -m bench.dev.fault`: what losing a worker costs under load.

Starts `epd serve` (as `bench compare` does), sends one trace at
`--request-rate`, and `--kill-at` seconds into it kills the worker of
`--kill-role` with SIGKILL (its pid comes from the supervisor's
"EPD: worker <id> pid <n>" line). It reports

  completed / failed        requests that got an answer / an error
  recovered                 requests the server sent again to live workers
                            (its epd:requests_recovered_total)
  server back after         the kill until /health is 200 again (restart,
                            model load, registration)
  goodput back after        the kill until the first request from which on
                            >= 90% of the requests sent meet the SLOs

It talks to the server over HTTP only (and reads
the log of the server it started, to find the pid).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx

from epd.bench import serve as bench_serve
from epd.bench.client import RequestResult
from epd.bench.compare import cpu_set, _Server
from epd.bench.metrics import meets_slos, parse_goodput
from epd.bench.report import results_from_json
from epd.transport.wire.roles import Mode, Role

ATTAINMENT = 0.9  # DistServe's goodput threshold
HEALTH_POLL_S = 0.2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", help="checkpoint directory to serve")
    p.add_argument("--mode", default=str(Mode.E_P_D), choices=[str(m) for m in Mode])
    p.add_argument("--kill-role", required=True, choices=[str(r) for r in Role])
    p.add_argument("--kill-at", type=float, default=10.0, help="seconds into the trace")
    p.add_argument("--cpus", default=None, help="CPU list the server is pinned to (default: all)")
    p.add_argument("--cpu-sharing", default="shared")
    p.add_argument("--server-args", default="", help="extra `epd serve` flags")
    p.add_argument("--output-dir", default="bench-results")
    bench_serve.add_arguments(p)
    p.set_defaults(num_prompts=60, input_len=200, output_len=32, image_size=[(224, 224)], no_progress=True)


def worker_pid(log: str, role: str) -> tuple[str, int]:
    """(worker id, latest pid) of the first worker of `role` in a server log."""
    pids = dict(re.findall(r"EPD: worker (\S+) pid (\d+)", log))
    for worker_id, pid in pids.items():
        if worker_id.rpartition("-")[0] == role:
            return worker_id, int(pid)
    raise ValueError(f"no {role} worker in the server log (is --mode right?)")


def goodput_back_after_s(results: list[RequestResult], kill_s: float, slos_ms: dict[str, float]) -> float | None:
    """Seconds from the kill until the first request sent after it from which on
    at least 90% of requests meet the SLOs; None if that never happens."""
    after = sorted((r for r in results if r.start_s >= kill_s), key=lambda r: r.start_s)
    for i, first in enumerate(after):
        rest = after[i:]
        if sum(r.success and meets_slos(r, slos_ms) for r in rest) >= ATTAINMENT * len(rest):
            return first.start_s - kill_s
    return None


def main(args) -> dict:
    if not args.goodput:
        raise ValueError("give the SLOs with --goodput ttft:MS tpot:MS")
    slos_ms = parse_goodput(args.goodput)
    args.tokenizer = args.tokenizer or args.model_dir
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    label = f"fault-{args.mode}-{args.kill_role}"
    server = _Server(args, args.mode, args.cpu_sharing, cpu_set(args.cpus), out_dir / f"{label}-server.log")
    try:
        server.wait_ready()
        warmup = copy.copy(args)
        warmup.num_prompts, warmup.seed, warmup.base_url = 2, args.seed + 1000, server.base_url
        warmup.request_rate, warmup.save_result = float("inf"), None
        bench_serve.main(warmup)
        worker_id, pid = worker_pid(Path(server._log.name).read_text(), args.kill_role)
        killer = _Killer(server.base_url, pid, args.kill_at)
        run = copy.copy(args)
        run.base_url, run.save_result, run.save_detailed = server.base_url, str(out_dir / f"{label}.json"), True
        killer.start()
        result = bench_serve.main(run)
        killer.join()
        recovered = _metric_sum(server.base_url, "epd:requests_recovered_total")
    finally:
        server.stop()
    results = results_from_json(result)
    kill_s = killer.killed_at_s - killer.started_s  # on the trace's clock (starts with the run)
    summary = {
        "mode": args.mode, "killed": worker_id, "kill_at_s": round(kill_s, 2), "request_rate": args.request_rate,
        "num_prompts": len(results), "completed": sum(r.success for r in results),
        "failed": sum(not r.success for r in results), "recovered": recovered,
        "server_back_after_s": killer.back_after_s,
        "goodput_back_after_s": goodput_back_after_s(results, kill_s, slos_ms),
        "slos_ms": slos_ms,
    }
    print(json.dumps(summary, indent=2))
    (out_dir / f"{label}-summary.json").write_text(json.dumps(summary, indent=2))
    return summary


class _Killer(threading.Thread):
    """SIGKILLs `pid` `delay_s` after start, then times /health back to 200."""

    def __init__(self, base_url: str, pid: int, delay_s: float):
        super().__init__(daemon=True)
        self.base_url, self.pid, self.delay_s = base_url, pid, delay_s
        self.started_s = self.killed_at_s = 0.0
        self.back_after_s: float | None = None

    def run(self) -> None:
        self.started_s = time.monotonic()
        time.sleep(self.delay_s)
        self.killed_at_s = time.monotonic()
        os.kill(self.pid, signal.SIGKILL)
        deadline = self.killed_at_s + 600
        time.sleep(HEALTH_POLL_S)  # the supervisor notices within 0.1 s; do not read the old state
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    self.back_after_s = round(time.monotonic() - self.killed_at_s, 2)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(HEALTH_POLL_S)


def _metric_sum(base_url: str, name: str) -> float:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and (len(line) == len(name) or line[len(name)] in " {"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.dev.fault", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return parser


if __name__ == "__main__":
    main(build_parser().parse_args())
