"""`epd bench serve` with `vllm bench serve`'s command lines (bench/vllm_names.py),
against the real local streaming server of tests/testkit/fake_openai_server.py."""
from __future__ import annotations

import argparse
import base64
import io
import json
import shlex

import pytest
from PIL import Image

from epd.bench.serve import add_arguments, main

from testkit.fake_openai_server import MODEL_NAME


def parse(command: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(shlex.split(command))


def _image_sizes(payload: dict) -> list[tuple[int, int]]:
    sizes = []
    content = payload["messages"][0]["content"]
    for part in [] if isinstance(content, str) else content:  # text only: a plain string
        if part["type"] == "image_url":
            data = base64.b64decode(part["image_url"]["url"].split(",", 1)[1])
            sizes.append(Image.open(io.BytesIO(data)).size)
    return sizes


def test_a_vllm_random_mm_command_line_runs_unchanged(fake_server, tmp_path):
    """vLLM's documented random-mm command (host, port, endpoint, buckets, limits,
    ranges, prefix, sampling, result file) drives the run as vLLM's would."""
    port = fake_server.base_url.rsplit(":", 1)[1]
    main(parse(
        f"--backend openai-chat --model {MODEL_NAME} --host 127.0.0.1 --port {port} "
        "--endpoint /v1/chat/completions --dataset-name random-mm --num-prompts 24 --max-concurrency 4 "
        "--random-prefix-len 5 --random-input-len 30 --random-output-len 4 --random-range-ratio 0.25 "
        "--random-mm-base-items-per-request 2 --random-mm-limit-mm-per-prompt '{\"image\": 3, \"video\": 0}' "
        "--random-mm-bucket-config '{(48, 64, 1): 0.5, (32, 32, 1): 0.5, (64, 64, 16): 0.0}' "
        "--random-mm-num-mm-items-range-ratio 1.0 --request-rate inf --ignore-eos --seed 42 "
        "--temperature 0.5 --top-p 0.9 --top-k 5 --percentile-metrics ttft,tpot --metric-percentiles 50,99 "
        f"--save-result --result-dir {tmp_path} --result-filename r.json --metadata gpu=none run=1 "
        "--num-warmups 2 --disable-tqdm --trust-remote-code"))
    payloads = fake_server.payloads[1:]  # after the test request
    assert len(payloads) == 2 + 24  # the warm-ups, then the run
    measured = payloads[2:]
    counts = [len(_image_sizes(p)) for p in measured]
    assert set(counts) <= {0, 1, 2, 3} and max(counts) == 3  # 2 +- 100%, capped at the image limit
    assert {size for p in measured for size in _image_sizes(p)} == {(64, 48), (32, 32)}  # (H, W, 1) buckets
    assert {p["max_tokens"] for p in measured} <= {3, 4, 5} and len({p["max_tokens"] for p in measured}) > 1
    content = [p["messages"][0]["content"] for p in measured]
    texts = [c if isinstance(c, str) else next(part["text"] for part in c if part["type"] == "text")
             for c in content]
    prefixes = {text.split()[0] for text in texts}
    assert len(prefixes) == 1  # one shared random prefix
    assert {(p["temperature"], p["top_p"], p["top_k"]) for p in measured} == {(0.5, 0.9, 5)}
    saved = json.loads((tmp_path / "r.json").read_text())
    assert (saved["gpu"], saved["run"], saved["backend"], saved["completed"]) == ("none", "1", "openai-chat", 24)
    assert "p99_ttft_ms" in saved and "median_tpot_ms" in saved
    assert not any(key.endswith(("_itl_ms", "_e2el_ms")) for key in saved)  # not among --percentile-metrics


def _videos(payload: dict) -> list[tuple[int, int, int]]:
    """(width, height, frames) of each video_url part, read back with PyAV."""
    import av

    out = []
    for part in payload["messages"][0]["content"]:
        if part["type"] == "video_url":
            url = part["video_url"]["url"]
            assert url.startswith("data:video/mp4;base64,")
            with av.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))) as container:
                frames = list(container.decode(video=0))
            out.append((frames[0].width, frames[0].height, len(frames)))
    return out


def test_video_buckets_send_real_mp4s_as_video_url_parts(fake_server):
    """vLLM's (H, W, T) buckets with T > 1 are videos: T frames of W x H in an mp4, one
    video_url part each, capped per request by the video limit (vLLM's rule: a
    modality at its cap is drawn no more), beside images of the T = 1 buckets."""
    pytest.importorskip("av")
    main(parse(
        f"--base-url {fake_server.base_url} --model {MODEL_NAME} --dataset-name random-mm --num-prompts 12 "
        "--random-input-len 8 --random-output-len 2 --random-mm-base-items-per-request 2 "
        "--random-mm-limit-mm-per-prompt '{\"image\": 2, \"video\": 1}' "
        "--random-mm-bucket-config '{(48, 64, 8): 0.5, (32, 32, 1): 0.5}' --disable-tqdm --seed 3"))
    measured = fake_server.payloads[1:]
    videos = [_videos(p) for p in measured]
    assert {v for vs in videos for v in vs} == {(64, 48, 8)}
    assert max(len(vs) for vs in videos) == 1 and any(videos)  # at most one video a request
    assert all(len(_image_sizes(p)) + len(vs) == 2 for p, vs in zip(measured, videos))
    assert {size for p in measured for size in _image_sizes(p)} == {(32, 32)}


def test_the_completions_backend_sends_prompts_and_reads_text_chunks(fake_server, tmp_path):
    result = main(parse(
        f"--backend openai --base-url {fake_server.base_url} --model {MODEL_NAME} --dataset-name random "
        f"--num-prompts 5 --random-input-len 8 --random-output-len 3 --save-result --result-dir {tmp_path} "
        "--label mine --disable-tqdm"))
    assert result["completed"] == 5 and result["total_output_tokens"] == 15 and result["backend"] == "openai"
    assert all("prompt" in p and "messages" not in p for p in fake_server.payloads)
    [saved] = list(tmp_path.glob("mine-infqps-fake-model-*.json"))  # vLLM's file name
    assert json.loads(saved.read_text())["label"] == "mine"


def test_append_result_adds_a_json_line(fake_server, tmp_path):
    out = tmp_path / "all.jsonl"
    for _ in range(2):
        main(parse(f"--base-url {fake_server.base_url} --model {MODEL_NAME} --dataset-name random --num-prompts 2 "
                   f"--random-input-len 4 --random-output-len 2 --save-result {out} --append-result --disable-tqdm"))
    assert [json.loads(line)["completed"] for line in out.read_text().splitlines()] == [2, 2]


@pytest.mark.parametrize("command, message", [
    ("--random-mm-bucket-config '{(0, 64, 8): 0.5, (32, 32, 1): 0.5}'", "audio is not served"),
    ("--random-mm-bucket-config '{(32, 32, 1): 0.0}'", "a probability above 0"),
    ("--backend openai --dataset-name random-mm", "needs the chat endpoint"),
    ("--backend openai --endpoint /v1/chat/completions", "speaks /v1/completions"),
    ("--percentile-metrics ttft,goodness", "goodness"),
    ("--random-range-ratio 1.5", "--random-range-ratio"),
    ("--metadata novalue", "KEY=VALUE"),
])
def test_what_epd_cannot_do_is_refused_by_name(command, message):
    with pytest.raises(ValueError, match=message):
        main(parse(f"--base-url http://127.0.0.1:9 --model m {command}"))


def test_vllm_flags_epd_lacks_are_refused_by_argparse_naming_them(capsys):
    with pytest.raises(SystemExit):
        parse("--profile")
    assert "--profile" in capsys.readouterr().err
