"""Video through `epd serve` (issue 26), in every mode's shared server: a chat
with a tiny video answers what the offline `LLM.chat` answers (greedy text,
prompt and output token ids, each token's top-5 logprobs), a repeat costs the encoders nothing, /tokenize counts what the
chat costs, and every bad video input is a 400 with an OpenAI error body while
the server goes on serving. Aggregated encodes the video in its engine worker."""
from __future__ import annotations

import httpx
import pytest
import torch
from testkit.api_checks import assert_error
from testkit.media import data_url, image_bytes, image_part
from testkit.mode_servers import SERVED_MODEL
from testkit.videos import (audio_only, claims_hours, claims_size, cut_after_header, encode_video, gif_frames,
                            synthetic_frames)

pytest.importorskip("av")
MAX_TOKENS = 6
TOP = 5  # logprobs compared per token: a wrong frame order or fps changes them even where the text agrees
CLIP = encode_video(synthetic_frames(9, 48, 64, seed=4), "mp4", fps=4)
OTHER_CLIP = encode_video(synthetic_frames(7, 40, 56, seed=5), "mp4", fps=3)
QUESTION = {"type": "text", "text": "What happens in the video?"}


def video_part(data: bytes, mime: str = "video/mp4") -> dict:
    return {"type": "video_url", "video_url": {"url": data_url(data, mime)}}


def chat(server, content: list[dict], **fields) -> httpx.Response:
    body = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            "temperature": 0, **fields}
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)


# (name, clip, mm_processor_kwargs): the checkpoint's sampling (2 fps), another clip, and the request's own
CASES = [("clip", CLIP, None), ("other", OTHER_CLIP, None), ("clip_at_4_fps", CLIP, {"fps": 4})]


@pytest.fixture(scope="module")
def offline(tiny_model):
    """(text, prompt ids, output ids, each token's top-5 (id, logprob)) of the offline LLM's greedy
    answer for each clip."""
    from epd.llm import LLM
    from epd.transport.wire.sampling import SamplingParams

    llm = LLM(tiny_model)
    out = {}
    for name, clip, kwargs in CASES:
        [result] = llm.chat([{"role": "user", "content": [video_part(clip), QUESTION]}],
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=TOP),
                            mm_processor_kwargs=kwargs)
        o = result.outputs[0]
        out[name] = (o.text, list(result.prompt_token_ids), list(o.token_ids), [lp.top for lp in o.logprobs])
    return out


def test_a_video_chat_answers_as_offline(mode_server, offline):
    for name, clip, kwargs in CASES:
        fields = {"mm_processor_kwargs": kwargs} if kwargs else {}
        response = chat(mode_server, [video_part(clip), QUESTION], logprobs=True, top_logprobs=TOP,
                        return_tokens_as_token_ids=True, return_token_ids=True, **fields)
        assert response.status_code == 200, response.text
        body = response.json()
        choice = body["choices"][0]
        text, prompt_ids, token_ids, tops = offline[name]
        assert (choice["message"]["content"], body["prompt_token_ids"], choice["token_ids"]) == \
            (text, prompt_ids, token_ids)
        assert body["usage"]["prompt_tokens"] == len(prompt_ids)
        served = [[(int(t["token"].removeprefix("token_id:")), t["logprob"]) for t in c["top_logprobs"]]
                  for c in choice["logprobs"]["content"]]
        assert [[t for t, _ in top] for top in served] == [[t for t, _ in top] for top in tops]
        torch.testing.assert_close([[v for _, v in top] for top in served], [[v for _, v in top] for top in tops],
                                   atol=1e-4, rtol=0)
    assert len(offline["clip_at_4_fps"][1]) > len(offline["clip"][1])  # more frames sampled: more placeholders


def test_a_repeated_video_costs_the_encoders_nothing(mode_server, offline):
    clip = encode_video(synthetic_frames(9, 48, 64, seed=11), "mp4", fps=4)  # this test's own
    first = chat(mode_server, [video_part(clip), QUESTION])
    assert first.status_code == 200, first.text
    encoded = mode_server.settled_sum("epd:encoder_images_total")
    again = chat(mode_server, [video_part(clip), QUESTION])
    assert again.json()["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]
    assert mode_server.settled_sum("epd:encoder_images_total") == encoded


def _modality_work(server) -> dict[str, tuple[float, float, float]]:
    """modality -> (items encoded, frames decoded, decodes timed), over every encoder, settled."""
    server.settled_sum("epd:encoder_items_total")
    return {m: (server.metric_sum("epd:encoder_items_total", modality=m),
                server.metric_sum("epd:encoder_frames_decoded_total", modality=m),
                server.metric_sum("epd:encoder_decode_seconds_count", modality=m)) for m in ("image", "video")}


def test_encoder_metrics_count_by_modality(mode_server, tiny_model):
    """An image request moves the image series by one item, one frame, one decode; a video
    request the video series by one item, one decode and the frames its plan decodes (every
    frame up to the last sampled one), whichever process encodes (aggregated: its engine worker)."""
    from epd.transport.media.video_geometry import VideoGeometry
    from epd.inputs.video_header import plan_video

    clip = encode_video(synthetic_frames(12, 48, 64, seed=21), "mp4", fps=8)  # this test's own: no cache hit
    _, plan = plan_video(clip, VideoGeometry.from_pretrained(tiny_model))
    before = _modality_work(mode_server)
    response = chat(mode_server, [image_part(image_bytes(70, 50, seed=21)), QUESTION])
    assert response.status_code == 200, response.text
    after_image = _modality_work(mode_server)
    assert after_image == {"image": tuple(v + d for v, d in zip(before["image"], (1, 1, 1))),
                           "video": before["video"]}
    response = chat(mode_server, [video_part(clip), QUESTION])
    assert response.status_code == 200, response.text
    frames = max(plan.frame_indices) + 1
    assert _modality_work(mode_server) == {"image": after_image["image"],
                                           "video": tuple(v + d for v, d in zip(before["video"], (1, frames, 1)))}
    assert mode_server.metric_sum("epd:encoder_decode_seconds_sum", modality="video") > 0


def test_tokenize_counts_a_video_as_its_chat_costs(mode_server):
    """/tokenize's count of a chat with a video (and its mm_processor_kwargs) is the chat's
    usage.prompt_tokens: the same preparer counts both, so one mode tells."""
    if mode_server.mode != "e-pd":
        pytest.skip("the API process counts; its preparer is the same in every mode")
    counts = []
    for kwargs in (None, {"fps": 4}, {"num_frames": 6}):
        fields = {"mm_processor_kwargs": kwargs} if kwargs else {}
        content = [video_part(CLIP), QUESTION]
        tokenized = httpx.post(mode_server.base_url + "/tokenize", timeout=60, json={
            "model": SERVED_MODEL, "messages": [{"role": "user", "content": content}], **fields})
        assert tokenized.status_code == 200, tokenized.text
        response = chat(mode_server, content, **fields)
        assert response.status_code == 200, response.text
        assert tokenized.json()["count"] == response.json()["usage"]["prompt_tokens"], kwargs
        counts.append(tokenized.json()["count"])
    assert counts[1] > counts[0] and counts[2] != counts[0]  # the kwargs were applied, not ignored


BAD = {  # name -> (content, mm_processor_kwargs, message, param)
    "bad_scheme": ([{"type": "video_url", "video_url": {"url": "ftp://127.0.0.1/v.mp4"}}, QUESTION], None,
                   "unsupported video url scheme", "messages"),
    "http_not_allowed": ([{"type": "video_url", "video_url": {"url": "http://127.0.0.1:9/v.mp4"}}, QUESTION], None,
                         "http(s) video urls are not allowed", "messages"),
    "not_base64": ([{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,@@"}}, QUESTION], None,
                   "invalid base64", "messages"),
    "url_not_an_object": ([{"type": "video_url", "video_url": "data:video/mp4;base64,AAAA"}, QUESTION], None,
                          "must be an object", "messages[0].content[0].video_url"),
    "over_the_limit": ([video_part(CLIP), video_part(OTHER_CLIP), QUESTION], None,
                       "at most 1 video per request", "messages"),
    "bad_kwargs_key": ([video_part(CLIP), QUESTION], {"max_frame_count": 8}, "max_frame_count cannot be applied",
                       "mm_processor_kwargs"),
    "fps_and_num_frames": ([video_part(CLIP), QUESTION], {"fps": 1, "num_frames": 4}, "exclude each other",
                           "mm_processor_kwargs"),
    "not_a_video": ([video_part(b"just text, no frames at all" * 10), QUESTION], None, "cannot open video",
                    "messages"),
    "audio_only": ([video_part(audio_only(), "audio/wav"), QUESTION], None, "the file has no video stream",
                   "messages"),
    "one_frame": ([video_part(encode_video(synthetic_frames(1, 48, 64), "mp4", fps=4)), QUESTION],
                  {"do_sample_frames": False}, "the model needs at least 2", "messages"),
    # headers that claim too much, each refused from the header (the server's default limits)
    "ten_hours": ([video_part(claims_hours(10, fps=30)), QUESTION], None,
                  "the video has 1080000 frames; the limit is 4096", "messages"),
    "10000x10000": ([video_part(claims_size(10000, 10000), "video/x-matroska"), QUESTION], None,
                    "video frames of 10000x10000 exceed the limit of 64000000 pixels", "messages"),
    "gif_of_5000_frames": ([video_part(gif_frames(5000), "image/gif"), QUESTION], None,
                           "the video has 5000 frames; the limit is 4096", "messages"),
}
HEADER_CLAIMS = ("ten_hours", "10000x10000", "gif_of_5000_frames")


@pytest.mark.parametrize("name", list(BAD))
def test_bad_video_input_is_a_400_and_the_server_serves_on(mode_server, name):
    content, kwargs, message, param = BAD[name]
    fields = {} if kwargs is None else {"mm_processor_kwargs": kwargs}
    assert_error(chat(mode_server, content, **fields), 400, message, param)
    ok = chat(mode_server, [{"type": "text", "text": "Still there?"}])
    assert ok.status_code == 200, ok.text


def test_headers_that_claim_too_much_cost_the_workers_nothing(mode_server):
    """Ten hours, 10000x10000, 5,000 frames: refused by the API from the header, so no
    worker sees an EncodeRequest, none restarts, and nothing is left running or queued."""
    received = mode_server.settled_sum("epd:encoder_requests_received_total")
    restarts = mode_server.metric_sum("epd:worker_restarts_total")
    for name in HEADER_CLAIMS:
        content, _, message, param = BAD[name]
        assert_error(chat(mode_server, content), 400, message, param)
    ok = chat(mode_server, [video_part(CLIP), QUESTION])  # a video still serves
    assert ok.status_code == 200, ok.text
    assert mode_server.settled_sum("epd:encoder_requests_received_total") <= received + 1  # CLIP's, if not cached
    assert mode_server.metric_sum("epd:worker_restarts_total") == restarts
    assert mode_server.settled_sum("epd:num_requests_running") == 0
    assert mode_server.metric_sum("epd:num_requests_waiting") == mode_server.metric_sum("epd:encoder_queued_patches") == 0


def test_a_video_only_the_encoder_finds_broken_is_a_400(mode_server):
    """Its header is whole, its frames are not: the encoder's EncodeDone(ok=False) fails
    the request (a 400 through the prefill worker's TokenOutput), and nothing else."""
    broken = cut_after_header(synthetic_frames(12, 48, 64, seed=7), fps=4)
    encoded = mode_server.settled_sum("epd:encoder_errors_total")
    assert_error(chat(mode_server, [video_part(broken), QUESTION]), 400, "the video ends before frame 11", "messages")
    assert mode_server.settled_sum("epd:encoder_errors_total") == encoded + 1
    ok = chat(mode_server, [video_part(CLIP), QUESTION])
    assert ok.status_code == 200, ok.text
