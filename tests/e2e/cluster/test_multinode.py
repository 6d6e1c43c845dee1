"""EPD across hosts with their own IP addresses: network namespaces on a
private bridge (tests/testkit/netns.py), a Ray head in one and Ray nodes in others.

* `epd worker --api tcp://` between namespaces, without Ray.
* `epd serve --cluster ray --encoders 1-2` on one machine (its own Ray): a
  burst adds an encoder actor, idleness removes it.
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
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
from testkit.hf_reference import hf_generate_text
from testkit.media import CHATS, costly_image, describe
from testkit.netns import Network, RayCluster, skip_reason
from testkit.server import ServerProcess, Traffic, assert_refused_for_a_down_role, image_burst

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
    # every one stopped cleanly, a worker that the API's Shutdown stopped before its Ctrl-C came too
    assert codes == [0] * len(codes), (codes, api.log(), *(w.log() for w in workers))
    assert not api.group_alive() and not any(w.group_alive() for w in workers)


def _wait_metrics(server: ServerProcess, condition, deadline_s: float, what: str) -> dict[str, float]:
    """The metrics once `condition(metrics)` holds; fails naming `what` after the deadline."""
    deadline = time.monotonic() + deadline_s
    while not condition(metrics := server.metrics()):
        assert time.monotonic() < deadline, f"{what}: not within {deadline_s} s; " + str(
            {k: v for k, v in metrics.items() if "encoder" in k}) + "\n" + server.log()[-3000:]
        time.sleep(0.25)
    return metrics


def _local_ray_env(tmp_path, **extra: str) -> tuple[dict, str]:
    """(environment, Ray's temp dir) for an `epd serve --cluster ray` that starts its own Ray."""
    token = tmp_path / "ray-token"
    token.write_text(os.urandom(16).hex())
    ray_tmp = tempfile.mkdtemp(prefix="epdt-ray-")  # Ray's session files; short: they hold unix sockets
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token), RAY_USAGE_STATS_ENABLED="0",
               RAY_TMPDIR=ray_tmp, RAY_DEDUP_LOGS="0", **extra)
    env.pop("RAY_ADDRESS", None)
    return env, ray_tmp


def _wait_nothing_left(host, ray_tmp: str) -> None:
    deadline = time.monotonic() + 30
    while host.pids():  # Ray's own processes end a moment after the driver
        assert time.monotonic() < deadline, f"left running: {host.pids()}"
        time.sleep(0.5)
    shutil.rmtree(ray_tmp, ignore_errors=True)


def test_cluster_ray_on_one_machine_starts_its_own_ray_and_scales_encoders(net, tiny_model, tmp_path):
    """`epd serve --cluster ray --encoders 1-2` without --ray-address: a local
    Ray (inside one namespace, on its loopback), each worker in an actor. A
    burst of fresh images (every encoder batch a second longer, as in
    tests/e2e/serve/test_encoder_autoscale.py) makes the encoder pool add a second
    actor, which takes images; idleness removes it. Every answer is
    transformers' text, and nothing of Ray is left once the server stops."""
    host = net.add_host("l")
    env, ray_tmp = _local_ray_env(tmp_path, EPD_TEST_ENCODER_BATCH_DELAY_S="1.0")
    port = 18720
    server = ServerProcess(["serve", tiny_model, "--mode", "e-pd", "--cluster", "ray", "--host", host.ip,
                            "--port", str(port), "--mm-cache-dir", str(tmp_path / "cache"),
                            "--encoders", "1-2", "--encoder-scale-up-queue-s", "0.3",
                            "--encoder-scale-up-window-s", "0.5", "--encoder-idle-s", "4",
                            "--encoder-scale-cooldown-s", "1", *SERVE_FLAGS], port, str(tmp_path / "api.log"),
                           host=host.ip, wrap=host.command([]), env=env)
    up, down = 'epd:encoder_scaling_decisions_total{direction="up"}', \
        'epd:encoder_scaling_decisions_total{direction="down"}'
    try:
        server.wait_ready(timeout_s=240)
        assert "encoder-0=tcp://127.0.0.1:" in server.log()  # the actor registered over tcp, CURVE
        start = server.metrics()
        assert (start["epd:encoders"], start[up], start[down]) == (1, 0, 0)
        with image_burst(server.base_url, num_clients=3, max_tokens=4) as burst:
            grown = _wait_metrics(server, lambda m: m["epd:encoders"] == 2 and server.metric_sum(
                "epd:encoder_images_total", worker="encoder-1") > 0, 240, "a second encoder actor taking images")
        assert grown[up] >= 1
        shrunk = _wait_metrics(server, lambda m: m["epd:encoders"] == 1 and m[down] >= 1, 90, "back to one encoder")
        assert shrunk[up] == shrunk[down]
        assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
        assert sum(v for k, v in shrunk.items() if k.startswith("epd:worker_restarts_total")) == 0
        answers = [result for *_, result in burst.results]
    finally:
        code = server.stop()
    assert code == 0, server.log()
    _wait_nothing_left(host, ray_tmp)
    assert answers and all(status == 200 for _, status, _ in answers), answers
    wrong = [seed for seed, _, text in answers
             if text != hf_generate_text(tiny_model, describe(costly_image(seed)), [costly_image(seed)], 4)]
    assert wrong == [], answers


@pytest.fixture(scope="module")
def ray_cluster(net, tmp_path_factory):
    hosts = _hosts(net)
    cluster = RayCluster(tmp_path_factory.mktemp("ray"), hosts["h"])
    cluster.start_head()
    cluster.add_nodes([(hosts["e"], 1, {"epd_encoder_node": 1}), (hosts["p"], 1, {"epd_prefill_node": 1}),
                       (hosts["d"], 1, {"epd_decode_node": 1})])
    yield cluster
    shutil.rmtree(cluster.ray_tmp, ignore_errors=True)


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

    def send(client: int, i: int) -> tuple[str, int, str]:
        names = (["text_only", "one_image"], ["two_images"])[client]
        name = names[i % len(names)]
        try:
            return (name, *_chat(ray_server, CHATS[name][0]))
        except httpx.HTTPError as exc:  # counted wrong below: neither a 503 nor the text
            return name, -1, repr(exc)

    with Traffic(send, num_clients=2, join_timeout_s=RECOVERY_DEADLINE_S) as traffic:
        traffic.wait_for(2, 120, "requests before the fault")
        killed_at = time.monotonic()
        assert decode.kill_all() > 0
        served_before = len(traffic.results)
        # back: a request sent after the fault finishes (it waited for a live decode worker)
        status, text = _chat(ray_server, CHATS["text_only"][0], timeout_s=RECOVERY_DEADLINE_S)
        recovery_s = time.monotonic() - killed_at
        assert (status, text) == (200, expected["text_only"])
        traffic.wait_for(served_before + 2, RECOVERY_DEADLINE_S, "traffic after the fault")
    results = [result for *_, result in traffic.results]
    print(f"\ndecode node lost: service back after {recovery_s:.1f} s; {len(results)} requests", flush=True)
    log = ray_server.log()
    assert re.search(rf"EPD worker decode-0: inbox tcp://{re.escape(spare.ip)}:", log), log[-3000:]
    assert ray_server.metric_sum("epd:worker_restarts_total", role="decode") >= 1
    wrong = [(name, status, text) for name, status, text in results
             if not (status == 503 or (status, text) == (200, expected[name]))]
    assert wrong == []


def _worker_actor_pids(host) -> list[int]:
    """The processes in `host` running a worker's actor (Ray titles them ray::WorkerActor...)."""
    pids = []
    for pid in host.pids():
        try:
            title = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
        except OSError:
            continue
        if title.startswith("ray::WorkerActor"):
            pids.append(pid)
    return pids


def test_cluster_ray_probes_a_down_role_again(net, tiny_model, tmp_path):
    """Issue 33 item 5 under Ray, as tests/e2e/serve/test_role_down.py for local workers:
    with `--max-restarts 0` the aggregated worker's actor process killed is given up
    on at once (its actor killed for good): a request gets a 503 with Retry-After at
    admission, and `--down-retry-interval` later the Ray supervisor creates a fresh
    actor, which registers and serves transformers' text."""
    host = net.add_host("r")
    env, ray_tmp = _local_ray_env(tmp_path)
    messages = CHATS["text_only"][0]
    expected = hf_generate_text(tiny_model, messages, [], max_new_tokens=MAX_TOKENS)
    port, retry_s = 18730, 8
    server = ServerProcess(["serve", tiny_model, "--mode", "aggregated", "--cluster", "ray", "--host", host.ip,
                            "--port", str(port), "--mm-cache-dir", str(tmp_path / "cache"), "--max-restarts", "0",
                            "--down-retry-interval", str(retry_s), *SERVE_FLAGS], port, str(tmp_path / "api.log"),
                           host=host.ip, wrap=host.command([]), env=env)
    try:
        server.wait_ready(timeout_s=240)
        body = {"model": httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["id"],
                "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
        (first,) = _worker_actor_pids(host)  # aggregated-0's
        os.kill(first, signal.SIGKILL)
        server.wait_health(503, 60)
        assert_refused_for_a_down_role(server, body)
        server.wait_health(200, retry_s + 180)  # probed again: a fresh actor, loaded, registered
        served = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
        assert served.status_code == 200, served.text
        assert served.json()["choices"][0]["message"]["content"] == expected
        now = _worker_actor_pids(host)
        assert len(now) == 1 and now != [first], (first, now)
        log = server.log()
        assert "its role is down; trying it again in 8 s" in log and "trying its role again" in log, log[-3000:]
        assert server.metric_sum("epd:worker_restarts_total", role="aggregated") == 1
    finally:
        code = server.stop()
    assert code == 0, server.log()
    _wait_nothing_left(host, ray_tmp)
