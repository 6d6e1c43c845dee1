"""EPD across hosts with their own IP addresses: network namespaces on a
private bridge (tests/netns.py), a Ray head in one and Ray nodes in others.

* `epd worker --api tcp://` between namespaces, without Ray.
* `epd serve --cluster ray`: encoder, prefill and decode pinned to three
  nodes by custom resources, each node its own embedding cache: greedy text
  equals transformers', /metrics shows embeddings and KV crossing nodes.
* A node lost mid-traffic (every process in its namespace killed): its
  worker comes back on a spare node, every request still gets its text.

Needs root, iproute2 and Ray; skipped with the reason otherwise. Every
namespace, veth and process (Ray's included) is removed at the end, pass or fail.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest
from hf_reference import hf_generate_text
from media import CHATS
from netns import Network, RayCluster, skip_reason
from server import ServerProcess

MAX_TOKENS = 10
SERVE_FLAGS = ["--num-kv-blocks", "256", "--dtype", "float32", "--device", "cpu"]
RECOVERY_DEADLINE_S = 180.0

_reason = skip_reason()
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600),  # a Ray cluster and three model loads on 2 CPUs
              pytest.mark.skipif(_reason is not None, reason=f"multi-node tests: {_reason}")]


@pytest.fixture(scope="module")
def expected(tiny_model):
    return {name: hf_generate_text(tiny_model, m, imgs, max_new_tokens=MAX_TOKENS) for name, (m, imgs) in CHATS.items()
            if name != "multi_turn"}


@pytest.fixture(scope="module")
def net():
    with Network("epdt") as network:
        for name in ("h", "e", "p", "d"):
            network.add_host(name)
        yield network
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert network.tag not in listed, "a namespace survived the test"


def _hosts(net: Network) -> dict:
    return {h.name: h for h in net.hosts}


def _chat(server: ServerProcess, messages: list[dict], stream: bool = True, timeout_s: float = 240.0
          ) -> tuple[int, str]:
    """(status, greedy text) of one chat over HTTP; streamed by default."""
    body = {"model": "m", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    body["model"] = httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=timeout_s)
    if r.status_code != 200:
        return r.status_code, r.text
    if not stream:
        return 200, r.json()["choices"][0]["message"]["content"]
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    if any("error" in c for c in chunks):
        return 500, r.text
    return 200, "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def _inboxes(log: str) -> dict[str, str]:
    """worker id -> inbox host, from the API's `EPD sockets:` line."""
    line = re.search(r"EPD sockets: (.*)", log).group(1)
    return {k: v.removeprefix("tcp://").rpartition(":")[0] for k, v in (p.split("=", 1) for p in line.split())}


def test_epd_worker_over_tcp_between_namespaces(net, tiny_model, tmp_path, expected):
    """The plain multi-host path, no Ray: `epd serve --external-workers` in one
    namespace, an encoder and a pd worker in two others, each its own cache."""
    hosts = _hosts(net)
    keys = tmp_path / "keys"
    assert subprocess.run([sys.executable, "-m", "epd.cli", "keys", str(keys)]).returncode == 0
    api_host = hosts["h"]
    port, worker_port = 18700, 18701
    api = ServerProcess(["serve", tiny_model, "--mode", "e-pd", "--external-workers", "--host", api_host.ip,
                         "--port", str(port), "--worker-port", str(worker_port), "--worker-keys", str(keys)],
                        port, str(tmp_path / "api.log"), host=api_host.ip, wrap=api_host.command([]))
    workers = [ServerProcess(["worker", tiny_model, "--role", role, "--api", f"tcp://{api_host.ip}:{worker_port}",
                              "--host", host.ip, "--mm-cache-dir", str(tmp_path / f"cache-{host.name}"),
                              "--threads", "1", "--worker-keys", str(keys), *SERVE_FLAGS],
                             0, str(tmp_path / f"{role}.log"), wrap=host.command([]))
               for role, host in (("encoder", hosts["e"]), ("pd", hosts["p"]))]
    try:
        api.wait_ready()
        for name in ("text_only", "one_image", "two_images"):
            assert _chat(api, CHATS[name][0]) == (200, expected[name])
        inboxes = _inboxes(api.log())
        assert inboxes["api"] == api_host.ip
        assert {v for k, v in inboxes.items() if k.startswith("encoder@")} == {hosts["e"].ip}
        assert {v for k, v in inboxes.items() if k.startswith("pd@")} == {hosts["p"].ip}
        # no shared cache: both images crossed from the encoder's namespace inside EncodeDone
        assert api.settled_sum("epd:encoder_inline_images_total") == 3
    finally:
        codes = [api.stop()] + [w.stop() for w in workers]
    assert codes[0] == 0, api.log()
    assert not api.group_alive() and not any(w.group_alive() for w in workers)


def test_cluster_ray_on_one_machine_starts_its_own_ray(net, tiny_model, tmp_path, expected):
    """`epd serve --cluster ray` without --ray-address: a local Ray (inside one
    namespace, on its loopback), the worker in an actor, and nothing of Ray
    left once the server stops."""
    host = net.add_host("l")
    token = tmp_path / "ray-token"
    token.write_text(os.urandom(16).hex())
    ray_tmp = tempfile.mkdtemp(prefix="epdt-ray-")  # Ray's session files; short: they hold unix sockets
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token), RAY_USAGE_STATS_ENABLED="0",
               RAY_TMPDIR=ray_tmp)
    env.pop("RAY_ADDRESS", None)
    port = 18720
    server = ServerProcess(["serve", tiny_model, "--mode", "aggregated", "--cluster", "ray", "--host", host.ip,
                            "--port", str(port), "--mm-cache-dir", str(tmp_path / "cache"), *SERVE_FLAGS], port, str(tmp_path / "api.log"), host=host.ip,
                           wrap=host.command([]), env=env)
    try:
        server.wait_ready(timeout_s=240)
        assert _chat(server, CHATS["one_image"][0]) == (200, expected["one_image"])
        assert "aggregated-0=tcp://127.0.0.1:" in server.log()  # the actor registered over tcp, CURVE
    finally:
        code = server.stop()
    assert code == 0, server.log()
    deadline = time.monotonic() + 30
    while host.pids():  # Ray's own processes end a moment after the driver
        assert time.monotonic() < deadline, f"left running: {host.pids()}"
        time.sleep(0.5)
    shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_cluster(net, tmp_path_factory):
    hosts = _hosts(net)
    cluster = RayCluster(tmp_path_factory.mktemp("ray"), hosts["h"])
    cluster.start_head()
    cluster.add_nodes([(hosts["e"], 1, {"epd_encoder_node": 1}), (hosts["p"], 1, {"epd_prefill_node": 1}),
                       (hosts["d"], 1, {"epd_decode_node": 1})])
    return cluster


@pytest.fixture(scope="module")
def ray_server(net, ray_cluster, tiny_model, tmp_path_factory):
    head = ray_cluster.head
    tmp = tmp_path_factory.mktemp("ray-serve")
    port = 18710
    resources = {role: json.dumps({"CPU": 1, f"epd_{role}_node": 1}) for role in ("encoder", "prefill", "decode")}
    server = ServerProcess(["serve", tiny_model, "--mode", "e-p-d", "--cluster", "ray", "--ray-address",
                            ray_cluster.address, "--host", head.ip, "--port", str(port),
                            "--encoder-resources", resources["encoder"], "--prefill-resources", resources["prefill"],
                            "--decode-resources", resources["decode"], "--mm-cache-dir", str(tmp / "cache"),
                            *SERVE_FLAGS], port, str(tmp / "api.log"), host=head.ip, wrap=head.command([]),
                           env=ray_cluster.env)
    server.cache_root = tmp / "cache"
    try:
        server.wait_ready(timeout_s=240)
        yield server
    finally:
        code = server.stop()
        assert code == 0, server.log()
        assert not server.group_alive(), "an API process survived Ctrl-C"


def test_e_p_d_on_three_ray_nodes_equals_transformers(ray_server, net, expected):
    hosts = _hosts(net)
    inboxes = _inboxes(ray_server.log())
    assert inboxes == {"api": hosts["h"].ip, "encoder-0": hosts["e"].ip, "prefill-0": hosts["p"].ip,
                       "decode-0": hosts["d"].ip}
    for name in ("text_only", "one_image", "two_images"):
        assert _chat(ray_server, CHATS[name][0], stream=False) == (200, expected[name])
    # embeddings crossed from the encoder's node to the prefill node, KV from the prefill to the decode node
    assert ray_server.settled_sum("epd:encoder_inline_images_total", worker="encoder-0") == 3
    assert ray_server.metric_sum("epd:encoder_inline_bytes_total", worker="encoder-0") > 0
    assert ray_server.metric_sum("epd:kv_transfer_bytes_total", worker="decode-0") > 0
    # each node its own embedding cache, none shared
    caches = sorted(p.name for p in ray_server.cache_root.iterdir())
    assert caches == sorted(f"node-{hosts[name].ip}" for name in "epd"), caches


def test_lost_node_comes_back_on_a_spare(ray_server, ray_cluster, net, expected):
    """Every process of the decode node killed mid-traffic: Ray restarts the
    decode worker on the spare node, it registers again, every request gets
    transformers' text (resumed or retried) or a 503, and service comes back."""
    spare = net.add_host("s")
    ray_cluster.add_nodes([(spare, 1, {"epd_decode_node": 1})])
    decode = _hosts(net)["d"]
    results: list[tuple[str, int, str]] = []
    stop = threading.Event()

    def traffic(names: list[str]) -> None:
        while not stop.is_set():
            for name in names:
                status, text = _chat(ray_server, CHATS[name][0])
                results.append((name, status, text))

    clients = [threading.Thread(target=traffic, args=(names,), daemon=True)
               for names in (["text_only", "one_image"], ["two_images"])]
    for c in clients:
        c.start()
    deadline = time.monotonic() + 120
    while len(results) < 2:  # traffic is flowing
        assert time.monotonic() < deadline, "no request finished before the fault"
        time.sleep(0.2)
    killed_at = time.monotonic()
    assert decode.kill_all() > 0
    served_before = len(results)
    # back: a request sent after the fault finishes (it waited for a live decode worker)
    status, text = _chat(ray_server, CHATS["text_only"][0], timeout_s=RECOVERY_DEADLINE_S)
    recovery_s = time.monotonic() - killed_at
    assert (status, text) == (200, expected["text_only"])
    while len(results) < served_before + 2:
        assert time.monotonic() < killed_at + RECOVERY_DEADLINE_S, "traffic did not resume"
        time.sleep(0.2)
    stop.set()
    for c in clients:
        c.join(timeout=RECOVERY_DEADLINE_S)
    print(f"\ndecode node lost: service back after {recovery_s:.1f} s; {len(results)} requests", flush=True)
    log = ray_server.log()
    assert re.search(rf"EPD worker decode-0: inbox tcp://{re.escape(spare.ip)}:", log), log[-3000:]
    assert ray_server.metric_sum("epd:worker_restarts_total", role="decode") >= 1
    wrong = [(name, status, text) for name, status, text in results
             if not (status == 503 or (status, text) == (200, expected[name]))]
    assert wrong == []
