"""Encoder routing and encoder metrics end to end, where caches are per host:
an `--external-workers` API on 127.0.0.1, two `epd worker` encoders each with
its own --mm-cache-dir and a pd worker with a third, over CURVE tcp. The API
sees none of these caches, so every image goes to an encoder."""
from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
from testkit.media import image_bytes, image_part
from testkit.server import ServerProcess, free_port

from epd.transport.media.image_geometry import ImageGeometry

MAX_TOKENS = 4


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("per-host-caches")
    keys = tmp / "keys"
    assert subprocess.run([sys.executable, "-m", "epd.cli", "keys", str(keys)]).returncode == 0
    port, worker_port = free_port(), free_port()
    api_address = f"tcp://127.0.0.1:{worker_port}"
    common = ["--api", api_address, "--dtype", "float32", "--device", "cpu", "--threads", "1",
              "--worker-keys", str(keys)]
    api = ServerProcess(["serve", tiny_model, "--mode", "e-pd", "--external-workers", "--port", str(port),
                         "--worker-port", str(worker_port), "--worker-keys", str(keys)], port, str(tmp / "api.log"))
    workers = [ServerProcess(["worker", tiny_model, "--role", "encoder", "--mm-cache-dir", str(tmp / f"cache-e{i}"),
                              *common], worker_port, str(tmp / f"encoder-{i}.log")) for i in range(2)]
    workers.append(ServerProcess(["worker", tiny_model, "--role", "pd", "--num-kv-blocks", "128",
                                  "--mm-cache-dir", str(tmp / "cache-pd"), *common], worker_port, str(tmp / "pd.log")))
    try:
        api.wait_ready()
        _wait_for(lambda: len(_encoder_ids(api)) == 2, timeout_s=120)
        api.encoders = _encoder_ids(api)
        api.geometry = ImageGeometry.from_pretrained(tiny_model)
        yield api
    finally:
        codes = [api.stop()] + [w.stop() for w in workers]
    # every one stopped cleanly, a worker that the API's Shutdown stopped before its Ctrl-C came too
    assert codes == [0] * len(codes), (codes, api.log(), *(w.log() for w in workers))
    assert not api.group_alive() and not any(w.group_alive() for w in workers)


def _encoder_ids(server: ServerProcess) -> list[str]:
    ids = {key.split('worker="', 1)[1].split('"', 1)[0] for key in server.metrics()
           if key.startswith("epd:encoder_requests_received_total{")}
    return sorted(ids)


def _wait_for(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.1)


def _chat(server: ServerProcess, content: list[dict]) -> httpx.Response:
    body = {"model": _model(server), "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            "temperature": 0}
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)


def _model(server: ServerProcess) -> str:
    return httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]


def _text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def _per_encoder(server: ServerProcess, name: str, **labels: str) -> dict[str, float]:
    return {e: server.metric_sum(name, worker=e, **labels) for e in server.encoders}


def _settled(server: ServerProcess, received: float) -> None:
    """Until the encoders reported receiving `received` requests in all and hold nothing."""
    _wait_for(lambda: server.metric_sum("epd:encoder_requests_received_total") == received
              and server.metric_sum("epd:encoder_queued_patches") == 0)
    server.settled_sum("epd:encoder_requests_total")


def test_a_repeated_image_goes_to_the_encoder_that_holds_it(cluster):
    img = image_bytes(96, 80, seed=301)
    content = [image_part(img), {"type": "text", "text": "What is it?"}]
    received = cluster.metric_sum("epd:encoder_requests_received_total")
    encoded = _per_encoder(cluster, "epd:encoder_requests_total", outcome="encoded")
    first = _text(_chat(cluster, content))
    _settled(cluster, received + 1)
    now = _per_encoder(cluster, "epd:encoder_requests_total", outcome="encoded")
    [holder] = [e for e in cluster.encoders if now[e] == encoded[e] + 1]
    hits = _per_encoder(cluster, "epd:encoder_requests_total", outcome="cache_hit")
    hit_tokens = cluster.metric_sum("epd:encoder_cache_hit_tokens_total", worker=holder)
    for _ in range(3):
        assert _text(_chat(cluster, content)) == first  # the embeddings read back from the holder's cache
    _settled(cluster, received + 4)
    assert _per_encoder(cluster, "epd:encoder_requests_total", outcome="encoded") == now  # never encoded again
    after = _per_encoder(cluster, "epd:encoder_requests_total", outcome="cache_hit")
    assert {e: after[e] - hits[e] for e in cluster.encoders} == {e: 3 if e == holder else 0 for e in cluster.encoders}
    assert cluster.metric_sum("epd:encoder_cache_hit_tokens_total", worker=holder) == \
        hit_tokens + 3 * cluster.geometry.num_image_tokens(96, 80)


METRICS = ["epd:encoder_requests_received_total", "epd:encoder_queue_time_seconds_count",
           "epd:encoder_batch_images_sum", "epd:encoder_batch_images_count", "epd:encoder_preprocess_seconds_count",
           "epd:encoder_forward_seconds_count", "epd:mm_cache_entries", "epd:mm_cache_evictions_total",
           "epd:request_images_count", "epd:request_images_sum", "epd:mm_cache_queries_total",
           "epd:mm_cache_hits_total", "epd:mm_cache_hit_tokens_total"]


def test_encoder_metrics_count_a_known_sequence(cluster):
    """Two new images in one request, a text-only request, an image that fails to decode."""
    before = {name: cluster.metric_sum(name) for name in METRICS}
    outcomes = {o: cluster.metric_sum("epd:encoder_requests_total", outcome=o)
                for o in ("encoded", "cache_hit", "error", "aborted")}
    transfers = {to: cluster.metric_sum("epd:encoder_transfer_seconds_count", to=to) for to in ("cache", "inline")}
    received = _per_encoder(cluster, "epd:encoder_requests_received_total")
    cache_bytes = cluster.metric_sum("epd:mm_cache_bytes")

    large, small = image_bytes(160, 120, seed=311), image_bytes(64, 48, seed=312)
    _text(_chat(cluster, [image_part(large), image_part(small), {"type": "text", "text": "Both?"}]))
    _settled(cluster, before["epd:encoder_requests_received_total"] + 2)
    now = _per_encoder(cluster, "epd:encoder_requests_received_total")
    assert {e: now[e] - received[e] for e in cluster.encoders} == {e: 1 for e in cluster.encoders}  # spread
    _text(_chat(cluster, [{"type": "text", "text": "No picture this time."}]))
    broken = image_bytes(64, 64, seed=313)
    bad = _chat(cluster, [image_part(broken[: len(broken) // 2]), {"type": "text", "text": "And this?"}])
    assert bad.status_code == 400 and "truncated" in bad.json()["error"]["message"]
    _settled(cluster, before["epd:encoder_requests_received_total"] + 3)

    delta = {name: cluster.metric_sum(name) - before[name] for name in METRICS}
    assert delta == {
        "epd:encoder_requests_received_total": 3, "epd:encoder_queue_time_seconds_count": 3,
        "epd:encoder_batch_images_sum": 2,  # the broken image never reached the tower
        "epd:encoder_batch_images_count": 2,  # one image on each encoder
        "epd:encoder_preprocess_seconds_count": 2, "epd:encoder_forward_seconds_count": 2,
        "epd:mm_cache_entries": 2, "epd:mm_cache_evictions_total": 0,
        "epd:request_images_count": 2, "epd:request_images_sum": 3,  # the text-only request is not counted
        "epd:mm_cache_queries_total": 3, "epd:mm_cache_hits_total": 0,  # the API reaches no worker's cache
        "epd:mm_cache_hit_tokens_total": 0}
    assert {o: cluster.metric_sum("epd:encoder_requests_total", outcome=o) - n for o, n in outcomes.items()} == \
        {"encoded": 2, "cache_hit": 0, "error": 1, "aborted": 0}
    # each encoder wrote its image to its own cache and sent it inline (the pd worker shares no cache)
    assert {to: cluster.metric_sum("epd:encoder_transfer_seconds_count", to=to) - n
            for to, n in transfers.items()} == {"cache": 2, "inline": 2}
    assert cluster.metric_sum("epd:mm_cache_bytes") > cache_bytes
