"""One video cut into temporal chunks (`--video-chunk-frames`) and encoded on two
encoders at once, e-p-d, for Qwen3-VL and Qwen2.5-VL, one server each: the
prompt tokens, the greedy tokens and the top-5 logprobs of each are the offline
`LLM.chat`'s (which encodes the video whole, in one pass, as one encoder does:
tests/e2e/serve/test_video_serve.py and test_serve_families.py serve it whole
and answer as `LLM.chat`); both encoders did part of it; a repeat costs no
encoder work; a video whose later frames are cut fails at the chunk that needs
them: a 400 for that request only, with no KV block, running or waiting request
left behind, and the server serves on; an encoder killed while it holds a
chunk: the request is sent again (the chunks already cached are not encoded
again) and answers the same, or, when the chunk was being encoded, fails as
the poison of that death (issue 44) and answers the same when the client
sends it again (the faults on Qwen3-VL only). There each chunk takes a second
more in the encoders (the tests' ENV_BATCH_DELAY), so the kill lands mid-chunk."""
from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import pytest
import torch
from testkit.api_checks import assert_error
from testkit.family_checkpoints import family_checkpoint
from testkit.media import data_url
from testkit.server import ServerProcess, free_port
from testkit.videos import cut_after_header, encode_video, synthetic_frames

pytest.importorskip("av")
MAX_TOKENS = 5
TOP = 5
FRAMES = synthetic_frames(9, 48, 64, seed=17)
CLIP = encode_video(FRAMES, "mp4", fps=4)
KWARGS = {"fps": 4}  # every frame: 5 temporal groups (Qwen2.5-VL samples none: every frame too)
CHUNKED = ("--video-chunk-frames", "2")  # a chunk per temporal group


def messages(clip: bytes) -> list[dict]:
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": data_url(clip, "video/mp4")}},
                                         {"type": "text", "text": "What happens in the video?"}]}]


def served(server, clip: bytes = CLIP) -> httpx.Response:
    model = httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    return httpx.post(server.base_url + "/v1/chat/completions", timeout=180, json={
        "model": model, "messages": messages(clip), "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "logprobs": True, "top_logprobs": TOP, "return_tokens_as_token_ids": True,
        "return_token_ids": True, "mm_processor_kwargs": KWARGS})


def answer(response: httpx.Response) -> tuple[list[int], list[int], list[list[tuple[int, float]]]]:
    """(prompt token ids, greedy token ids, each token's top-5 (id, logprob)) of a chat answer."""
    assert response.status_code == 200, response.text
    body = response.json()
    choice = body["choices"][0]
    tops = [[(int(t["token"].removeprefix("token_id:")), t["logprob"]) for t in c["top_logprobs"]]
            for c in choice["logprobs"]["content"]]
    return body["prompt_token_ids"], choice["token_ids"], tops


def offline(model_dir: str, clips: list[bytes]) -> list:
    """(prompt ids, greedy ids, top-5 logprobs) of each clip's chat by the offline LLM."""
    from epd.llm import LLM
    from epd.transport.wire.sampling import SamplingParams

    llm = LLM(model_dir, dtype="float32")
    outs = [llm.chat(messages(clip), SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                    logprobs=TOP), mm_processor_kwargs=KWARGS)[0] for clip in clips]
    return [(o.prompt_token_ids, o.outputs[0].token_ids, [lp.top for lp in o.outputs[0].logprobs]) for o in outs]


def assert_same(got, expected) -> None:
    assert got[0] == expected[0] and got[1] == expected[1]
    assert [[t for t, _ in top] for top in got[2]] == [[t for t, _ in top] for top in expected[2]]
    torch.testing.assert_close([[v for _, v in top] for top in got[2]], [[v for _, v in top] for top in expected[2]],
                               atol=1e-4, rtol=0)


def settled_idle(server) -> None:
    """Every engine worker holds no request and no KV block once its stats settle."""
    for name in ("epd:num_requests_running", "epd:num_requests_waiting", "epd:kv_cache_usage_perc"):
        assert server.settled_sum(name) == 0, name


def start_chunked_server(model_dir: str, tmp_path, slow: bool) -> ServerProcess:
    """e-p-d, two encoders, a chunk per temporal group; `slow`: each chunk a second longer to encode."""
    from testkit.encoder_delays import ENV_BATCH_DELAY

    port = free_port()
    args = ["serve", model_dir, "--mode", "e-p-d", "--port", str(port), "--num-kv-blocks", "256", "--dtype",
            "float32", "--device", "cpu", "--threads-per-worker", "1", "--encoders", "2",
            "--mm-cache-dir", str(tmp_path / "cache"), *CHUNKED]
    env = {**os.environ, ENV_BATCH_DELAY: "1"} if slow else None
    return ServerProcess(args, port, str(tmp_path / "server.log"), env=env).wait_ready()


def kill_mid_chunk(srv: ServerProcess, clip: bytes) -> httpx.Response:
    """`clip`'s answer, with encoder-1 killed (SIGKILL) once it has taken a chunk."""
    got = {}
    taken = srv.metric_sum("epd:encoder_requests_received_total", worker="encoder-1")  # earlier requests' chunks
    sender = threading.Thread(target=lambda: got.update(response=served(srv, clip)))
    sender.start()
    deadline = time.monotonic() + 60
    while srv.metric_sum("epd:encoder_requests_received_total", worker="encoder-1") < taken + 1:
        assert time.monotonic() < deadline, "encoder-1 never got a chunk"
        time.sleep(0.1)
    pids = {name: int(pid) for name, pid in re.findall(r"EPD: worker (\S+) pid (\d+)", srv.log())}
    os.kill(pids["encoder-1"], signal.SIGKILL)  # mid-chunk: each takes a second at least
    sender.join(timeout=120)
    assert not sender.is_alive(), "the request hung after its encoder died"
    return got["response"]


def _split_answers_as_offline(srv: ServerProcess, expected) -> None:
    assert_same(answer(served(srv)), expected)
    per_encoder = [srv.settled_sum("epd:encoder_images_total", worker=f"encoder-{i}") for i in range(2)]
    assert min(per_encoder) >= 1 and sum(per_encoder) == 5  # five chunks over both encoders
    assert_same(answer(served(srv)), expected)  # a repeat: every chunk's entries are cached
    assert srv.settled_sum("epd:encoder_images_total") == 5


@pytest.mark.slow
def test_a_qwen2_5_vl_video_split_over_two_encoders_answers_as_offline(tmp_path):
    """The family's own chunking (its positions, no timestamps); the faults are the family's
    business nowhere, so they are tested once, on Qwen3-VL, below."""
    model_dir = family_checkpoint("qwen2_5_vl")
    [expected] = offline(model_dir, [CLIP])
    srv = start_chunked_server(model_dir, tmp_path, slow=False)
    try:
        _split_answers_as_offline(srv, expected)
    finally:
        assert srv.stop() == 0, srv.log()


@pytest.mark.slow
def test_a_video_split_over_two_encoders_answers_as_offline_and_fails_alone(tiny_model, tmp_path):
    killed_clip = encode_video(synthetic_frames(9, 48, 64, seed=19), "mp4", fps=4)
    expected, expected_killed = offline(tiny_model, [CLIP, killed_clip])
    srv = start_chunked_server(tiny_model, tmp_path, slow=True)
    try:
        _split_answers_as_offline(srv, expected)

        broken = cut_after_header(FRAMES, fps=4, keep=0.8)  # frames 0 to 4 decode: the first chunks only
        errors = srv.settled_sum("epd:encoder_errors_total")
        assert_error(served(srv, broken), 400, "the video ends before frame", "messages")
        assert srv.settled_sum("epd:encoder_errors_total") >= errors + 1
        settled_idle(srv)

        recovered = srv.metric_sum("epd:requests_recovered_total")
        response = kill_mid_chunk(srv, killed_clip)
        if response.status_code == 200:  # the chunk was queued, not encoding: sent again
            assert_same(answer(response), expected_killed)
            assert srv.metric_sum("epd:requests_recovered_total") >= recovered + 1
        else:  # the chunk it was encoding is the suspect of its death (issue 44): failed, not sent again
            error = assert_error(response, 400, "died while encoding this request's videos", "messages")
            assert error["code"] == "input_crashed_worker"
            srv.wait_health(200, 300)
            assert_same(answer(served(srv, killed_clip)), expected_killed)  # sent again by the client
        settled_idle(srv)
    finally:
        assert srv.stop() == 0, srv.log()
