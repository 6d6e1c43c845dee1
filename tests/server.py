"""Running a real `epd serve` (or `epd worker`) in tests: a subprocess in its
own process group, ready when /health answers 200, stopped with SIGINT like
Ctrl-C, and checked to leave no process behind."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def start_server(model: str, log_dir, mode: str, *extra: str) -> ServerProcess:
    """`epd serve` of `model` on a free port, small KV cache, float32 on CPU, one thread a worker."""
    port = free_port()
    args = ["serve", model, "--mode", mode, "--port", str(port), "--num-kv-blocks", "256",
            "--dtype", "float32", "--device", "cpu", "--threads-per-worker", "1", *extra]
    return ServerProcess(args, port, str(Path(log_dir) / f"server-{mode}-{port}.log")).wait_ready()


def chat_text(server: ServerProcess, messages: list[dict], max_tokens: int, stream: bool = False) -> str:
    """Greedy text of one chat, over plain HTTP (streamed: the deltas joined)."""
    model = httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["choices"][0]["message"]["content"]
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert all("error" not in c for c in chunks), r.text
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], port: int, log_path: str, wait_health: bool = True,
                 host: str = "127.0.0.1", wrap: list[str] = (), env: dict | None = None):
        """`wrap`: a prefix that execs the command (`ip netns exec NS`); `host`: where its HTTP port is."""
        self.port = port
        self.base_url = f"http://{host}:{port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        env = dict(env or os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([*wrap, sys.executable, "-m", "epd.cli", *args], stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True, env=env)
        self.pgid = self.proc.pid

    def wait_ready(self, timeout_s: float = 180.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not healthy after {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path) as f:
            return f.read()

    def metrics(self) -> dict[str, float]:
        """Metric samples as {'name{labels}': value}."""
        text = httpx.get(self.base_url + "/metrics", timeout=5.0).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def metric_sum(self, name: str, **labels: str) -> float:
        """Sum of a metric over the series whose labels include `labels`."""
        total = 0.0
        for key, value in self.metrics().items():
            base = key.split("{", 1)[0]
            if base != name:
                continue
            got = dict(re.findall(r'(\w+)="([^"]*)"', key))
            if all(got.get(k) == v for k, v in labels.items()):
                total += value
        return total

    def settled_sum(self, name: str, **labels: str) -> float:
        """`metric_sum` once workers' periodic stats (every 0.25 s) stopped changing it."""
        value = self.metric_sum(name, **labels)
        while True:
            time.sleep(0.6)
            again = self.metric_sum(name, **labels)
            if again == value:
                return value
            value = again

    def stop(self, timeout_s: float = 30.0) -> int:
        """Ctrl-C, then wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.pgid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def group_alive(self, grace_s: float = 5.0) -> bool:
        """Whether a process of the server's group is still running `grace_s`
        after the server exited (helpers such as multiprocessing's resource
        tracker exit a moment after their parent)."""
        deadline = time.monotonic() + grace_s
        while self._group_alive_now():
            if time.monotonic() > deadline:
                return True
            time.sleep(0.1)
        return False

    def _group_alive_now(self) -> bool:
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        # killpg(0) also succeeds for zombies; look for live members.
        out = subprocess.run(["ps", "-eo", "pgid=,stat="], capture_output=True, text=True).stdout
        rows = [line.split() for line in out.splitlines() if line.strip()]
        return any(int(pgid) == self.pgid and not stat.startswith("Z") for pgid, stat in rows)
