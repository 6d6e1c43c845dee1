"""Requests that go away (a client disconnecting mid-stream or while its images
encode frees every worker's share at once), the vLLM metric set, and load:
200 concurrent requests mixed with bad ones, 40 broken images at once."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
from testkit.api_checks import (IMAGE_MESSAGES, IMG, MAX_MODEL_LEN, TEXT_MESSAGES, answer_text, assert_error,
                        assert_still_serving, chat_body, group_processes, messages_with, post, settled_zero,
                        url_part, worker_set)
from testkit.media import image_bytes, image_part


LONG = {"max_tokens": MAX_MODEL_LEN - 300, "ignore_eos": True}  # room for two images in the prompt


def test_disconnect_mid_stream_aborts_in_every_worker(server, expected):
    settled_zero(server, 10)
    aborted = server.settled_sum("epd:requests_aborted_total", role="decode")
    body = chat_body(TEXT_MESSAGES, stream=True, **LONG)
    with httpx.Client(timeout=60) as client, client.stream("POST", server.base_url + "/v1/chat/completions",
                                                           json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        num_chunks = 0
        while num_chunks < 30:
            num_chunks += next(lines).startswith("data: {")
        deadline = time.monotonic() + 5
        while server.metric_sum("epd:kv_cache_usage_perc", role="decode") == 0:  # it runs on decode now
            assert time.monotonic() < deadline
            time.sleep(0.05)
    settled_zero(server, 60)  # every block freed
    # taken out by the Abort, not run to its end
    assert server.settled_sum("epd:requests_aborted_total", role="decode") == aborted + 1
    assert_still_serving(server, expected)


def test_disconnect_while_images_encode_frees_everything(server, expected):
    """Gone as soon as the API sent the images to the encoder (typically before
    the first byte): the encoder's queue, the prefill worker's pending request
    and every block are freed."""
    settled_zero(server, 10)
    images = [image_bytes(256, 256, seed=900 + i) for i in range(2)]
    payload = json.dumps(chat_body(messages_with(*map(image_part, images)), stream=True, **LONG)).encode()
    queried = server.metric_sum("epd:mm_cache_queries_total")
    aborted = server.settled_sum("epd:requests_aborted_total")
    encoded = server.settled_sum("epd:encoder_images_total") + server.settled_sum("epd:encoder_images_aborted_total")
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: epd\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % len(payload) + payload)
        deadline = time.monotonic() + 10
        while server.metric_sum("epd:mm_cache_queries_total") < queried + 2:  # EncodeRequests are leaving
            assert time.monotonic() < deadline
        while not any(server.metric_sum(n) for n in ("epd:num_requests_waiting", "epd:num_requests_running")):
            assert time.monotonic() < deadline  # a worker holds it (its EncodeRequests left with it)
            time.sleep(0.02)
    settled_zero(server, 60)  # no request runs or waits, no block is held
    # aborted, not run to its end: the Abort took it out of the prefill or decode worker,
    # and each image was either encoded or dropped from the encoder's queue
    assert server.settled_sum("epd:requests_aborted_total") >= aborted + 1
    assert server.settled_sum("epd:encoder_images_total") + \
        server.settled_sum("epd:encoder_images_aborted_total") == encoded + 2
    assert_still_serving(server, expected, "image")


# -- metrics ---------------------------------------------------------------------------------------

VLLM_NAMES = [
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
    "prefix_cache_hits_total", "mm_cache_queries_total", "mm_cache_hits_total", "prompt_tokens_total",
    "generation_tokens_total", "request_success_total", "num_preemptions_total",
    "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
    "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket",
    "encoder_queue_time_seconds_sum", "encode_seconds_sum", "kv_transfer_seconds_sum", "kv_transfer_bytes_total",
]


def test_vllm_metric_names(server, expected):
    queued = server.metric_sum("epd:request_queue_time_seconds_count")
    assert_still_serving(server, expected, "image")
    names = {key.split("{", 1)[0] for key in server.metrics()}
    assert [n for n in VLLM_NAMES if f"epd:{n}" not in names] == []
    assert server.metric_sum("epd:request_success_total", finished_reason="length") >= 1
    assert server.metric_sum("epd:request_queue_time_seconds_count") == queued + 1
    assert server.metric_sum("epd:kv_transfer_bytes_total", role="decode") > 0
    assert server.settled_sum("epd:encode_seconds_count", role="encoder") >= 1



def test_200_concurrent_requests_mixed_with_bad_ones(server, expected):
    good = {"text": chat_body(TEXT_MESSAGES), "image": chat_body(IMAGE_MESSAGES)}
    for i in range(3):
        good[f"short-{i}"] = chat_body([{"role": "user", "content": f"Number {i} is the best, isn't it?"}])
    reference = {name: answer_text(post(server, body)) for name, body in good.items()}
    assert reference["text"] == expected["text"] and reference["image"] == expected["image"]
    bad = [(b"{not json", 400), (json.dumps(chat_body(messages_with(image_part(b"GIF89a?")))).encode(), 400),
           (json.dumps(chat_body(messages_with(url_part("data:image/png;base64,!!notbase64!!")))).encode(), 400),
           (json.dumps({**chat_body(TEXT_MESSAGES), "model": "nope"}).encode(), 404),
           (json.dumps(chat_body(TEXT_MESSAGES, temperature=-1)).encode(), 400),
           (json.dumps(chat_body(TEXT_MESSAGES, max_tokens=MAX_MODEL_LEN + 1)).encode(), 400),
           (json.dumps(chat_body(messages_with(url_part("http://example.com/x.png")))).encode(), 400)]
    names = list(good)
    jobs = [("good", names[i % len(names)], i % 2 == 1) for i in range(150)] + \
           [("bad", i % len(bad), i % 2 == 1) for i in range(50)]
    jobs = [jobs[(i * 37) % len(jobs)] for i in range(len(jobs))]  # interleaved (37 is coprime to 200)
    workers, pids = worker_set(server), group_processes(server)

    async def run_all():
        limits = httpx.Limits(max_connections=len(jobs))
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60, limits=limits) as client:
            async def one(kind, key, stream):
                headers = {"content-type": "application/json"}
                if kind == "good":
                    body = {**good[key], "stream": stream}
                    return await client.post("/v1/chat/completions", json=body, headers=headers)
                content, _ = bad[key]
                return await client.post("/v1/chat/completions", content=content, headers=headers)
            return await asyncio.gather(*(one(*job) for job in jobs))

    responses = asyncio.run(run_all())
    for (kind, key, _), response in zip(jobs, responses):
        if kind == "good":
            assert answer_text(response) == reference[key]
        else:
            assert_error(response, bad[key][1])
    assert worker_set(server) == workers and group_processes(server) == pids
    assert server.log().count("EPD ready") == 1
    settled_zero(server, 10)


def test_many_requests_with_one_broken_image_all_fail(server, expected):
    """Only the encoder finds this image broken, for 40 requests at once, while
    80 good ones keep the prefill worker busy (its inbox fills from both pipes)."""
    broken = chat_body(messages_with(image_part(IMG[:301])))
    bodies = [broken if i % 3 == 0 else chat_body(TEXT_MESSAGES, max_tokens=16) for i in range(120)]

    async def run_all():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=10,
                                     limits=httpx.Limits(max_connections=len(bodies))) as client:
            return await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies),
                                        return_exceptions=True)

    responses = asyncio.run(run_all())
    hung = sum(isinstance(r, httpx.TimeoutException) for r in responses)
    assert hung == 0, f"{hung} of {len(bodies)} requests never answered"
    for body, response in zip(bodies, responses):
        if body is broken:
            assert_error(response, 400, "could not be encoded", "messages")
        else:
            assert response.status_code == 200
    settled_zero(server, 10)
    assert_still_serving(server, expected, "image")

