"""Early prefill end to end (e-p-d, two encoders): one image size is held
back in the encoder (`EPD_TEST_SLOW_IMAGE`), so the first image of a request
arrives seconds after its second. The prefill worker fills KV blocks before
it arrives, the text equals transformers', and when a late image fails
instead, only that request fails (400) and every block is freed."""
from __future__ import annotations

import threading
import time

import httpx
import pytest
from testkit.hf_reference import hf_generate_text
from testkit.media import CHATS, image_bytes, image_part
from testkit.mode_servers import SLOW_H, SLOW_W

pytestmark = pytest.mark.parametrize("mode_server", ["e-p-d"], indirect=True)

MAX_TOKENS = 8
SYSTEM = {"role": "system", "content": "You compare pictures for a careful reader, in a few words. " * 4}
SLOW = image_bytes(SLOW_W, SLOW_H, seed=41)
FAST = image_bytes(64, 40, seed=42)
LATE = [SYSTEM, {"role": "user", "content": [image_part(SLOW), {"type": "text", "text": "versus"},
                                             image_part(FAST), {"type": "text", "text": "Which is brighter?"}]}]


@pytest.fixture(scope="module")
def server(mode_server):
    """The shared e-p-d server (tests/testkit/mode_servers.py): two encoders, SLOW_W x SLOW_H
    images held back HOLD_S. Its text-only prompts up to 64 tokens are prefilled on
    the decode worker, longer ones and every image prompt by the prefill worker."""
    return mode_server


def post_chat(server, messages) -> httpx.Response:
    body = {"model": server_model(server), "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)


def server_model(server) -> str:
    return httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]


def in_background(fn, *args) -> tuple[threading.Thread, dict]:
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", fn(*args)), daemon=True)
    thread.start()
    return thread, result


def prefill_kv_usage(server) -> float:
    return server.metric_sum("epd:kv_cache_usage_perc", role="prefill")


def wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def test_late_out_of_order_images_are_prefilled_around_and_equal_transformers(server, tiny_model):
    expected = hf_generate_text(tiny_model, LATE, [SLOW, FAST], max_new_tokens=MAX_TOKENS)
    # The system prompt alone first: the text before the images is then in the prefix cache.
    assert post_chat(server, [SYSTEM, {"role": "user", "content": "Ready?"}]).status_code == 200
    hits = server.settled_sum("epd:prefix_cache_hits_total", role="prefill")
    wait_for(lambda: prefill_kv_usage(server) == 0)

    thread, result = in_background(post_chat, server, LATE)
    # While its first image is held back, the prefill worker already holds the
    # blocks of the text before it (without early prefill it would hold none).
    wait_for(lambda: prefill_kv_usage(server) > 0 or not thread.is_alive())
    assert thread.is_alive(), "the request finished before its held-back image could have arrived"
    thread.join(timeout=120)
    response = result["value"]
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == expected
    assert server.settled_sum("epd:prefix_cache_hits_total", role="prefill") - hits >= 64
    wait_for(lambda: prefill_kv_usage(server) == 0)


def test_a_failing_second_image_fails_only_its_request_and_frees_its_blocks(server, tiny_model):
    broken = image_bytes(SLOW_W, SLOW_H, seed=43)[:120]  # a readable header, then nothing: fails to decode
    bad = [{"role": "user", "content": [image_part(FAST), {"type": "text", "text": "and"},
                                        image_part(broken), {"type": "text", "text": "Compare."}]}]
    # beside it: a short text (prefilled on the decode worker), a long text and an image
    # prompt (through the prefill worker that holds the failing request's blocks)
    others = {name: CHATS[name] for name in ("text_only", "one_image")}
    others["long_text"] = ([SYSTEM, {"role": "user", "content": "Ready?"}], [])
    expected = {name: hf_generate_text(tiny_model, m, imgs, max_new_tokens=MAX_TOKENS)
                for name, (m, imgs) in others.items()}

    bad_thread, bad_result = in_background(post_chat, server, bad)
    wait_for(lambda: prefill_kv_usage(server) > 0 or not bad_thread.is_alive())
    assert bad_thread.is_alive(), "the failure came back before the held-back image"
    runs = {name: in_background(post_chat, server, m) for name, (m, _) in others.items()}
    bad_thread.join(timeout=120)
    response = bad_result["value"]
    assert response.status_code == 400, response.text
    assert "image" in response.json()["error"]["message"]
    for name, (thread, result) in runs.items():
        thread.join(timeout=120)
        assert result["value"].status_code == 200, result["value"].text
        assert result["value"].json()["choices"][0]["message"]["content"] == expected[name]
    wait_for(lambda: prefill_kv_usage(server) == 0
             and server.metric_sum("epd:kv_cache_usage_perc", role="decode") == 0)
    assert post_chat(server, others["text_only"][0]).json()["choices"][0]["message"]["content"] \
        == expected["text_only"]
