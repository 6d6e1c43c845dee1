"""A role that is down fails fast and comes back (issue 33, item 5).

A real aggregated server with `--max-restarts 0`: its one worker killed is
given up on at once, so its role is down. A request then gets a 503 with
Retry-After at admission (it used to wait out --request-timeout, 600 s by
default: the client's 30 s timeout here would fail the test), the dead
worker's gauges leave /metrics, and `--down-retry-interval` later the
supervisor tries the worker again: it registers and serves transformers'
text."""
from __future__ import annotations

import os
import re
import signal

import httpx
from testkit.hf_reference import hf_generate_text
from testkit.server import assert_refused_for_a_down_role, start_server

MESSAGES = [{"role": "user", "content": "Say something about boats."}]
RETRY_S = 8  # --down-retry-interval: long enough to see the role down, short for the suite


def test_a_role_down_is_refused_at_once_and_probed_again(tiny_model, tmp_path):
    expected = hf_generate_text(tiny_model, MESSAGES, [], 4)
    server = start_server(tiny_model, tmp_path, "aggregated", "--max-restarts", "0",
                          "--down-retry-interval", str(RETRY_S))
    try:
        model = httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
        pid = int(re.search(r"EPD: worker aggregated-0 pid (\d+)", server.log()).group(1))
        os.kill(pid, signal.SIGKILL)
        server.wait_health(503, 10)
        assert_refused_for_a_down_role(server, body)
        metrics = httpx.get(server.base_url + "/metrics", timeout=10).text
        assert 'epd:requests_refused_total{reason="role_down"} 1.0' in metrics
        assert not re.search(r'epd:num_requests_running\{[^}]*worker="aggregated-0"', metrics)  # no stale gauge
        server.wait_health(200, RETRY_S + 60)  # tried again: restarted, loaded, registered
        served = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
        assert served.status_code == 200, served.text
        assert served.json()["choices"][0]["message"]["content"] == expected
        assert "trying its role again" in server.log()
    finally:
        assert server.stop() == 0, server.log()
