"""Running a real `epd serve` (or `epd worker`) in tests: a subprocess in its
own process group, ready when /health answers 200, stopped with SIGINT like
Ctrl-C, and checked to leave no process behind. A server outlives no test run:
one the tests did not stop is stopped at the test process's exit (an
interrupted run skips the fixtures' teardown), and gets SIGINT from the kernel
if the test process dies without exiting (`died_with_parent`: pytest-xdist's
workers, SIGKILL). `Traffic`: clients sending
requests to it from threads until stopped (chaos, autoscaling, a lost node)."""
from __future__ import annotations

import atexit
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from testkit.encoder_delays import with_delay_site


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


def served_top5(server: ServerProcess, messages: list[dict], max_tokens: int) -> tuple[list[list[tuple[int, float]]], int]:
    """A greedy chat's steps (each one's top-5 (token id, logprob), the greedy token first; checked
    greedy) and its prompt's length in tokens."""
    model = httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 5, "return_tokens_as_token_ids": True}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    steps = r.json()["choices"][0]["logprobs"]["content"]
    assert [s["token"] for s in steps] == [s["top_logprobs"][0]["token"] for s in steps]  # greedy
    top5 = [[(int(t["token"].removeprefix("token_id:")), t["logprob"]) for t in s["top_logprobs"]] for s in steps]
    return top5, r.json()["usage"]["prompt_tokens"]


def assert_refused_for_a_down_role(server: ServerProcess, body: dict) -> None:
    """`body` sent while its role is down: a 503 at admission (not after --request-timeout),
    Retry-After, and the reason in an OpenAI error body."""
    refused = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=30)
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"] == "10"
    assert "role is down" in refused.json()["error"]["message"]


class Traffic:
    """`num_clients` threads, each calling `send(client, i)` for i = 0, 1, ...
    back to back until the `with` block ends; `results` holds (client, i,
    what send returned), in the order they finished. An exception out of
    `send` (a hang past its client timeout, a broken stream) is kept as
    (-1, repr(exc)). Leaving the block waits up to `join_timeout_s` for the
    requests in flight and fails if a client never got its answer."""

    def __init__(self, send: Callable[[int, int], Any], num_clients: int, join_timeout_s: float):
        self.results: list[tuple[int, int, Any]] = []
        self._send = send
        self._join_timeout_s = join_timeout_s
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(c,), daemon=True) for c in range(num_clients)]

    def _loop(self, client: int) -> None:
        i = 0
        while not self._stop.is_set():
            try:
                result = self._send(client, i)
            except Exception as exc:
                result = (-1, repr(exc))
            self.results.append((client, i, result))
            i += 1

    def wait_for(self, count: int, timeout_s: float, what: str = "requests") -> None:
        """Until `count` results are in; fails after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while len(self.results) < count:
            assert time.monotonic() < deadline, f"{what}: {len(self.results)} of {count} within {timeout_s} s"
            time.sleep(0.2)

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        deadline = time.monotonic() + self._join_timeout_s
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self._threads), "a client never got an answer"


def image_burst(base_url: str, num_clients: int, max_tokens: int, timeout_s: float = 300.0) -> Traffic:
    """Traffic of greedy chats, each with a fresh `costly_image` (nothing
    cached, every image encoded); results (client, i, (seed, status, text)),
    seed = 1000 * client + i."""
    from testkit.media import costly_image, describe

    model = httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]

    def send(client: int, i: int) -> tuple[int, int, str]:
        seed = 1000 * client + i
        body = {"model": model, "messages": describe(costly_image(seed)), "max_tokens": max_tokens,
                "temperature": 0}
        try:
            r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=timeout_s)
        except httpx.HTTPError as exc:
            return seed, -1, repr(exc)
        return seed, r.status_code, r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text

    return Traffic(send, num_clients, join_timeout_s=timeout_s + 30)


# Execs argv[2:] after asking the kernel for SIGINT once the process that started it is gone (its
# parent pid, argv[1]: if it is gone already, SIGINT at once). PR_SET_PDEATHSIG survives the exec.
_DIE_WITH_PARENT = ("import ctypes, os, signal, sys; "
                    "ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGINT); "
                    "os.getppid() == int(sys.argv[1]) or os.kill(os.getpid(), signal.SIGINT); "
                    "os.execv(sys.argv[2], sys.argv[2:])")


def died_with_parent(*argv: str) -> list[str]:
    """`argv`, to run as a process that gets SIGINT (Ctrl-C: `epd serve` stops cleanly) when
    this test process dies. Linux's parent-death signal follows the thread that started the
    process, so from another thread `argv` runs as it is (the exit handler still stops it)."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return list(argv)
    return [sys.executable, "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]


_RUNNING: set[ServerProcess] = set()  # started, not yet stopped


@atexit.register
def _stop_the_running() -> None:
    """At the test process's exit (an interrupted run skips fixture teardown): every server still running."""
    for server in list(_RUNNING):
        server.stop(timeout_s=10.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], port: int, log_path: str, wait_health: bool = True,
                 host: str = "127.0.0.1", wrap: list[str] = (), env: dict | None = None, cwd: str | None = None):
        """`wrap`: a prefix that execs the command (`ip netns exec NS`); `host`: where its HTTP port is;
        `cwd`: the directory it runs in (a relative checkpoint path). An `env` that asks for
        encoder delays (testkit/encoder_delays.py) gets them in every encoder worker."""
        self.port = port
        self.base_url = f"http://{host}:{port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        env = with_delay_site(dict(env or os.environ, PYTHONUNBUFFERED="1"))
        self.proc = subprocess.Popen([*wrap, *died_with_parent(sys.executable, "-m", "epd.cli", *args)],
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
                                     cwd=cwd)
        self.pgid = self.proc.pid
        _RUNNING.add(self)

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

    def wait_health(self, status: int, timeout_s: float) -> None:
        """Until /health answers `status` (a role down: 503; back: 200); fails after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while httpx.get(self.base_url + "/health", timeout=5).status_code != status:
            assert time.monotonic() < deadline, f"/health never became {status}:\n{self.log()[-3000:]}"
            time.sleep(0.1)

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

    def settled_sum(self, name: str, timeout_s: float = 120.0, **labels: str) -> float:
        """`metric_sum` once workers' periodic stats (every 0.25 s) stopped changing it;
        an AssertionError if it still changes after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        value = self.metric_sum(name, **labels)
        while time.monotonic() < deadline:
            time.sleep(0.6)
            again = self.metric_sum(name, **labels)
            if again == value:
                return value
            value = again
        raise AssertionError(f"{name} {labels} still changing after {timeout_s:.0f} s (last {value})")

    def stop(self, timeout_s: float = 30.0) -> int:
        """Ctrl-C, then wait; returns the exit code."""
        _RUNNING.discard(self)
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
