"""The core lease (transport/host/core_lease.py), on by default, in a real e-p-d deployment:
the decode worker marks itself busy in the run's lease file while it steps a
request, and clears the mark once it has nothing left to step."""
from __future__ import annotations

import re
import struct
import threading
import time
from pathlib import Path

import httpx
from testkit.server import ServerProcess, free_port

from epd.transport.host.core_lease import lease_path


def marks(path: str) -> tuple[float, ...]:
    data = Path(path).read_bytes()
    return struct.unpack(f"{len(data) // 8}d", data)


def test_the_decode_worker_holds_its_mark_while_it_steps_and_clears_it_after(tiny_model, tmp_path):
    port = free_port()
    srv = ServerProcess(["serve", tiny_model, "--mode", "e-p-d", "--port", str(port), "--num-kv-blocks", "256",
                         "--dtype", "float32", "--device", "cpu"],  # the default: --core-lease
                        port, str(tmp_path / "server.log")).wait_ready()
    try:
        run_dir = re.search(r"api=ipc://(\S+)/api\.sock", srv.log()).group(1)
        lease = lease_path(run_dir)
        assert marks(lease) == (0.0, 0.0)  # the prefill and the decode worker's: nothing stepped yet
        body = {"model": httpx.get(srv.base_url + "/v1/models", timeout=30).json()["data"][0]["id"],
                "prompt": "hello there", "max_tokens": 300, "ignore_eos": True, "temperature": 0}
        got = {}
        sender = threading.Thread(target=lambda: got.update(r=httpx.post(srv.base_url + "/v1/completions",
                                                                          json=body, timeout=120)))
        sender.start()
        seen_busy, deadline = False, time.monotonic() + 120
        while sender.is_alive() and not seen_busy and time.monotonic() < deadline:
            seen_busy = marks(lease)[1] > 0.0  # the decode worker's slot (encoder: none; prefill 0, decode 1)
            time.sleep(0.002)
        sender.join(timeout=120)
        assert got["r"].status_code == 200, got["r"].text
        assert got["r"].json()["usage"]["completion_tokens"] == 300
        assert seen_busy, "the decode worker never marked itself busy while decoding 300 tokens"
        deadline = time.monotonic() + 30
        while marks(lease) != (0.0, 0.0):
            assert time.monotonic() < deadline, f"marks left after the request: {marks(lease)}"
            time.sleep(0.05)
    finally:
        srv.stop()
