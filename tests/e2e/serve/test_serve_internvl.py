"""`epd serve` of InternVL (dense and MoE) in e-p-d, e-pd and aggregated: a text and a
two-image chat, plain and streamed, give transformers' greedy text (the tiles'
embeddings through the encoder worker and the cache, the 1-D positions and the
KV across three processes); in e-p-d a chat with an image and a video (frames
sampled by the request's mm_processor_kwargs) gives transformers' prompt ids,
greedy tokens and top-5 logprobs (testkit/family_video_reference.py)."""
from __future__ import annotations

import openai
import pytest
import torch
from testkit.internvl_reference import hf_generate_text
from testkit.media import CHATS, IMG_A, data_url, image_part
from testkit.server import chat_text, start_server

from epd.tools.make_model import make_model

MAX_TOKENS = 10
VIDEO_KWARGS = {"do_sample_frames": True, "num_frames": 3}


def _video_reference(model_dir: str, work) -> tuple[list[dict], tuple]:
    """(the chat with an image and a video, transformers' (prompt ids, greedy tokens, top-5 logprobs))."""
    from testkit.family_video_reference import internvl_greedy
    from testkit.video_reference import VideoClips
    from testkit.videos import encode_video, synthetic_frames

    from epd.encoders.video_io import decode_frames, read_video_meta

    clip = encode_video(synthetic_frames(7, 48, 80, seed=6), "mp4", fps=5)
    video = {"type": "video_url", "video_url": {"url": data_url(clip, "video/mp4")}}
    messages = [{"role": "user", "content": [image_part(IMG_A), video, {"type": "text", "text": "What happens?"}]}]
    meta = read_video_meta(clip)
    clips = VideoClips([(decode_frames(clip, range(meta.num_frames)), meta)], VIDEO_KWARGS, work)
    return messages, internvl_greedy(model_dir, [(messages, [IMG_A], clips)], MAX_TOKENS)[0]
CHAT_NAMES = ["text_only", "two_images", "multi_turn"]


@pytest.mark.slow
@pytest.mark.parametrize(("preset", "mode"), [("internvl-tiny", "e-p-d"), ("internvl-tiny", "aggregated"),
                                              ("internvl-moe-tiny", "e-p-d"), ("internvl-moe-tiny", "e-pd")])
def test_served_text_equals_transformers(preset, mode, tmp_path):
    model_dir = str(make_model(tmp_path / "ckpt", preset, seed=2))
    expected = {n: hf_generate_text(model_dir, CHATS[n][0], CHATS[n][1], max_new_tokens=MAX_TOKENS)
                for n in CHAT_NAMES}
    with_video = (preset, mode) == ("internvl-tiny", "e-p-d")
    if with_video:
        video_chat, (video_prompt, video_tokens, video_tops) = _video_reference(model_dir, tmp_path / "video-ref")
    srv = start_server(model_dir, tmp_path, mode)
    try:
        for name in CHAT_NAMES:
            assert chat_text(srv, CHATS[name][0], MAX_TOKENS) == expected[name], name
            assert chat_text(srv, CHATS[name][0], MAX_TOKENS, stream=True) == expected[name], name
        if with_video:
            client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
            r = client.chat.completions.create(
                model=client.models.list().data[0].id, messages=video_chat, max_tokens=MAX_TOKENS, temperature=0,
                logprobs=True, top_logprobs=5,
                extra_body={"return_token_ids": True, "ignore_eos": True, "mm_processor_kwargs": VIDEO_KWARGS})
            assert r.model_extra["prompt_token_ids"] == video_prompt
            assert r.choices[0].model_extra["token_ids"] == video_tokens
            served = [[t.logprob for t in step.top_logprobs] for step in r.choices[0].logprobs.content]
            torch.testing.assert_close(served, [[v for _, v in top] for top in video_tops], atol=1e-4, rtol=0)
    finally:
        assert srv.stop() == 0, srv.log()
    assert not srv.group_alive(), "a server process survived Ctrl-C"
