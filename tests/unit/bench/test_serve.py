"""`bench.serve.main` end to end against a real local streaming HTTP server (see conftest.py)."""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import math
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from epd.bench.client import build_payload, send_chat_request
from epd.bench.datasets import BenchRequest, make_image_bytes
from epd.bench.metrics import compute_metrics
from epd.bench.report import format_table, results_from_json
from epd.bench.serve import add_arguments, build_requests, main

from testkit.fake_openai_server import MODEL_NAME, TOKENS_PER_IMAGE


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_random_mm_run_saves_consistent_aggregates_and_arrays(fake_server, tmp_path, capsys):
    out = tmp_path / "result.json"
    result = main(parse(
        "--base-url", fake_server.base_url, "--model", MODEL_NAME, "--dataset", "random-mm",
        "--num-prompts", "16", "--input-len", "20", "--output-len", "6", "--images-per-request", "2",
        "--image-size", "64x48,32x32", "--repeat-image-ratio", "0.5", "--text-only-ratio", "0.25",
        "--request-rate", "200", "--max-concurrency", "4", "--goodput", "ttft:5000", "tpot:5000",
        "--percentiles", "50,99", "--save-result", str(out), "--save-detailed", "--seed", "1", "--no-progress"))
    saved = json.loads(out.read_text())
    assert "Serving Benchmark Result" in capsys.readouterr().out

    n = 16
    assert saved["num_prompts"] == n and saved["completed"] == n and saved["failed"] == 0
    assert saved["errors"] == [""] * n
    assert saved["model_id"] == MODEL_NAME and saved["request_rate"] == 200 and saved["max_concurrency"] == 4
    for name in ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "generated_texts"):
        assert len(saved[name]) == n, name
    # aggregates agree with the per-request arrays
    assert saved["mean_ttft_ms"] == pytest.approx(1000 * np.mean(saved["ttfts"]))
    assert saved["p99_ttft_ms"] == pytest.approx(1000 * np.percentile(saved["ttfts"], 99))
    assert saved["mean_e2el_ms"] == pytest.approx(1000 * np.mean(saved["latencies"]))
    tpots = [(e - t) / (o - 1) for e, t, o in zip(saved["latencies"], saved["ttfts"], saved["output_lens"])]
    assert saved["mean_tpot_ms"] == pytest.approx(1000 * np.mean(tpots))
    assert saved["mean_itl_ms"] == pytest.approx(1000 * np.mean([x for itls in saved["itls"] for x in itls]))
    assert saved["total_output_tokens"] == sum(saved["output_lens"]) == n * 6
    assert saved["total_input_tokens"] == sum(saved["input_lens"])
    assert saved["request_throughput"] == pytest.approx(n / saved["duration"])
    assert saved["request_goodput"] == pytest.approx(n / saved["duration"])  # generous SLOs: all good
    # exact output lengths: one content chunk per token, so output_len - 1 gaps
    assert all(len(itls) == 5 for itls in saved["itls"])
    assert all(text == "t0 t1 t2 t3 t4 t5 " for text in saved["generated_texts"])
    # input length is the server's usage.prompt_tokens: 20 words + the image placeholders
    assert saved["input_lens"] == [20 + TOKENS_PER_IMAGE * k for k in saved["num_images"]]
    assert 0 in saved["num_images"] and 2 in saved["num_images"]
    assert saved["num_text_only_completed"] + saved["num_image_completed"] == n
    assert saved["text_only_mean_ttft_ms"] > 0 and saved["image_p99_ttft_ms"] > 0
    # open loop on a normalized schedule: the last request is sent at n / rate seconds, not before
    assert max(saved["start_times"]) >= n / 200
    # the returned dict is what was saved
    assert {k: result[k] for k in saved} == saved
    # recomputing from the per-request arrays gives the same aggregates
    again = compute_metrics(results_from_json(saved), saved["duration"], [50, 99], {"ttft": 5000, "tpot": 5000})
    for key, value in again.items():
        assert saved[key] == pytest.approx(value), key

    # what the server saw: the probe, then n requests asking for exact lengths
    bodies = fake_server.payloads[1:]
    assert len(bodies) == n
    for body in bodies:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["max_tokens"] == body["min_tokens"] == 6 and body["ignore_eos"] is True
        for part in body["messages"][0]["content"] if isinstance(body["messages"][0]["content"], list) else []:
            if part["type"] == "image_url":
                payload = part["image_url"]["url"].split(",", 1)[1]
                assert Image.open(io.BytesIO(base64.b64decode(payload))).size in {(64, 48), (32, 32)}
    assert fake_server.peak_in_flight <= 4


def test_jsonl_run_records_failures_and_saves_no_arrays_by_default(fake_server, tmp_path):
    (tmp_path / "a.jpg").write_bytes(make_image_bytes(40, 40, seed=0))
    lines = [{"prompt": "look at this", "images": ["a.jpg"], "output_len": 3},
             {"prompt": "please FAIL"},
             {"prompt": "short text", "output_len": 1}]
    data = tmp_path / "reqs.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "result.json"
    result = main(parse("--base-url", fake_server.base_url + "/", "--dataset", "jsonl", "--dataset-path", str(data),
                        "--output-len", "4", "--save-result", str(out), "--no-progress"))
    assert result["model_id"] == MODEL_NAME  # from GET /v1/models
    assert (result["completed"], result["failed"]) == (2, 1)
    assert result["errors"][1] == "HTTP 400: bad prompt FAIL"
    assert result["output_lens"] == [3, 0, 1]
    assert result["input_lens"][0] == 3 + TOKENS_PER_IMAGE
    assert result["mean_tpot_ms"] == pytest.approx(
        1000 * (result["latencies"][0] - result["ttfts"][0]) / 2)  # the 1-token request has no TPOT
    assert result["request_goodput"] is None and result["request_rate"] == "inf"
    saved = json.loads(out.read_text())
    assert "ttfts" not in saved and "errors" not in saved
    assert saved["completed"] == 2 and saved["mean_ttft_ms"] == result["mean_ttft_ms"]
    table = format_table(saved, [50, 90, 99])
    assert "Failed requests:" in table and "P90 TPOT (ms):" in table


def test_load_is_open_loop_and_max_concurrency_caps_it(fake_server):
    fake_server.token_delay_s = 0.05  # 4 tokens: ~0.2 s a request
    common = ("--base-url", fake_server.base_url, "--model", MODEL_NAME, "--dataset", "random",
              "--num-prompts", "6", "--input-len", "5", "--output-len", "4", "--no-progress")
    start = time.perf_counter()
    result = main(parse(*common))
    assert time.perf_counter() - start < 1.0  # all 6 at once, not one after another (~1.2 s)
    assert fake_server.peak_in_flight == 6
    assert result["completed"] == 6
    fake_server.peak_in_flight = 0
    result = main(parse(*common, "--max-concurrency", "2"))
    assert fake_server.peak_in_flight == 2
    assert result["duration"] > 0.55  # 3 waves of ~0.2 s


def test_request_timeout_and_unreachable_server_are_failures_not_crashes(fake_server):
    fake_server.token_delay_s = 0.2

    async def go():
        async with httpx.AsyncClient() as http:
            url = fake_server.base_url + "/v1/chat/completions"
            slow = await send_chat_request(http, url, MODEL_NAME, BenchRequest("hi", 5), timeout_s=0.1)
            down = await send_chat_request(http, "http://127.0.0.1:9/v1/chat/completions", MODEL_NAME,
                                           BenchRequest("hi", 5), timeout_s=5)
        return slow, down

    slow, down = asyncio.run(go())
    assert not slow.success and slow.error == "timeout after 0.1 s"
    assert not down.success and "Connect" in down.error


def test_bad_flags_and_dead_server_give_clear_errors(fake_server):
    with pytest.raises(ValueError, match="goodput"):
        main(parse("--goodput", "latency:5", "--dataset", "random", "--num-prompts", "1"))
    with pytest.raises(ValueError, match="--dataset-path"):
        main(parse("--dataset", "jsonl"))
    with pytest.raises(SystemExit):
        parse("--request-rate", "fast")
    with pytest.raises(ValueError, match="cannot get the model name"):
        main(parse("--base-url", "http://127.0.0.1:9", "--dataset", "random", "--num-prompts", "1",
                   "--no-progress"))
    with pytest.raises(ValueError, match="test request .* failed: ConnectError"):
        main(parse("--base-url", "http://127.0.0.1:9", "--model", "m", "--dataset", "random",
                   "--num-prompts", "1", "--no-progress"))
    assert math.isinf(parse().request_rate)


def test_text_first_puts_the_prompt_before_the_images():
    """vLLM's bench sends the text first; ours sends images first unless --text-first,
    on the same seeded requests."""
    argv = ("--num-prompts", "3", "--input-len", "8", "--images-per-request", "2", "--image-size", "32x32")
    kinds = [[part["type"] for part in build_payload("m", r)["messages"][0]["content"]]
             for r in build_requests(parse(*argv))]
    assert kinds == [["image_url", "image_url", "text"]] * 3
    default, text_first = build_requests(parse(*argv)), build_requests(parse(*argv, "--text-first"))
    assert [build_payload("m", r)["messages"][0]["content"][0]["type"] for r in text_first] == ["text"] * 3
    assert [(r.prompt, r.image_urls) for r in text_first] == [(r.prompt, r.image_urls) for r in default]
