"""`epd worker` runs with `epd serve`'s CPU discipline (issue 33, item 8):
OpenMP threads that sleep when they wait, and the thread count the launcher's
rule gives its role (epd/processes/threads.py), not every core. Checked in a real
`epd worker` process: libgomp's own report of what it read when torch loaded
it (`OMP_DISPLAY_ENV=VERBOSE`: PASSIVE makes its spin count 0) and the
process's `torch.get_num_threads()`."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
from testkit.server import free_port

from epd.processes.threads import available_cores, worker_threads
from epd.transport.wire.roles import Role

SPIN_COUNT = re.compile(r"GOMP_SPINCOUNT = '(\d+)'")
THREADS = re.compile(r"EPD worker \S+: (\d+) torch threads, OMP_WAIT_POLICY=(\S+)")


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys"
    assert subprocess.run([sys.executable, "-m", "epd.cli", "keys", str(path)], capture_output=True).returncode == 0
    return str(path)


def worker_cpu(tiny_model: str, keys: str, role: str, *extra: str) -> tuple[int, int, str]:
    """(libgomp's spin count, torch threads, OMP_WAIT_POLICY) of a real `epd worker`,
    started with no wait policy in its environment; stopped once it has said them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    env.update(OMP_DISPLAY_ENV="VERBOSE", PYTHONUNBUFFERED="1")
    # nothing listens on the API port: the worker only has to start (ZeroMQ connects lazily)
    cmd = [sys.executable, "-m", "epd.cli", "worker", tiny_model, "--role", role,
           "--api", f"tcp://127.0.0.1:{free_port()}", "--dtype", "float32", "--device", "cpu",
           "--worker-keys", keys, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines, deadline = [], time.monotonic() + 120
    try:
        for line in proc.stdout:
            lines.append(line)
            if THREADS.search(line) or time.monotonic() > deadline:
                break
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    output = "".join(lines)
    spin, threads = SPIN_COUNT.search(output), THREADS.search(output)
    assert spin and threads, output
    return int(spin.group(1)), int(threads.group(1)), threads.group(2)


def test_epd_worker_sleeps_when_waiting_and_takes_the_launchers_threads(tiny_model, keys):
    spin_count, num_threads, policy = worker_cpu(tiny_model, keys, "encoder")
    assert (spin_count, policy) == (0, "PASSIVE")  # libgomp read PASSIVE: no spinning
    assert num_threads == worker_threads(Role.ENCODER, [Role.ENCODER], available_cores(), "shared")
    assert num_threads == max(1, available_cores() - 1)  # every core but the API's, not every core


def test_threads_per_worker_flag(tiny_model, keys):
    assert worker_cpu(tiny_model, keys, "decode", "--threads-per-worker", "3") == (0, 3, "PASSIVE")
