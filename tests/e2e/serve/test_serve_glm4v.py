"""`epd serve` of GLM-4.1V and GLM-4.5V (float32, CPU, prefill chunks of 16 tokens
cutting through the images): a two-image chat and a text chat give
transformers' prompt token ids, every prompt token's logprob, greedy tokens
and each step's top-5 logprobs, through the aggregated worker and across
e-p-d's three processes (embeddings from the encoder, the KV handed over);
GLM-4.1V's chat with an image and a video its prompt ids, greedy tokens and
top-5 logprobs (the video encoded in-process, or by the encoder worker a
temporal group an entry; testkit/family_video_reference.py)."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import openai
import pytest
import torch
from testkit.family_checkpoints import family_checkpoint
from testkit.hf_reference import _load, _mm_token_types, hf_inputs
from testkit.media import CHATS, IMG_A, data_url, image_part
from testkit.server import start_server

NUM_TOKENS = 6
TOP = 5
CASES = ["two_images", "text_only"]


@torch.no_grad()
def _reference(model_dir: str, case: str) -> tuple[list[int], torch.Tensor, list[int], list[list[float]]]:
    """transformers': (prompt ids, the prompt's log-softmax [n, vocab], greedy tokens, each step's top-5 logprobs)."""
    messages, images = CHATS[case]
    model, _, _ = _load(model_dir)
    inputs = hf_inputs(model_dir, messages, images)
    ids = inputs["input_ids"]
    prompt = ids[0].tolist()
    prompt_logprobs, tokens, tops = None, [], []
    for _ in range(NUM_TOKENS):
        logits = model(**dict(inputs, input_ids=ids, mm_token_type_ids=_mm_token_types(model, ids))).logits[0]
        rows = logits.float().log_softmax(-1)
        if prompt_logprobs is None:
            prompt_logprobs = rows
        tokens.append(int(rows[-1].argmax()))
        tops.append(rows[-1].topk(TOP).values.tolist())
        ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], dim=1)
    return prompt, prompt_logprobs, tokens, tops


def _video_chat() -> tuple[list[dict], bytes]:
    from testkit.videos import encode_video, synthetic_frames

    clip = encode_video(synthetic_frames(12, 60, 90, seed=4), "mp4", fps=5)  # 2 fps: 4 frames, 2 groups
    video = {"type": "video_url", "video_url": {"url": data_url(clip, "video/mp4")}}
    return [{"role": "user", "content": [image_part(IMG_A), video, {"type": "text", "text": "What happens?"}]}], clip


@lru_cache(maxsize=None)
def _video_reference(model_dir: str, work: str) -> tuple[list[int], list[int], list[list]]:
    from testkit.family_video_reference import glm4v_greedy
    from testkit.video_reference import VideoClips

    from epd.encoders.video_io import decode_frames, read_video_meta

    messages, clip = _video_chat()
    meta = read_video_meta(clip)
    clips = VideoClips([(decode_frames(clip, range(meta.num_frames)), meta)], {}, Path(work))
    return glm4v_greedy(model_dir, [(messages, [IMG_A], clips)], NUM_TOKENS)[0]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "mode"), [("glm4v", "aggregated"), ("glm4v", "e-p-d"), ("glm4v_moe", "e-pd")])  # every mode once
def test_served_glm_equals_transformers(family, mode, tmp_path):
    model_dir = family_checkpoint(family)
    expected = {case: _reference(model_dir, case) for case in CASES}
    with_video = family == "glm4v"  # GLM-4.5V's vision side and prompt are GLM-4.1V's
    if with_video:
        video_prompt, video_tokens, video_tops = _video_reference(model_dir, str(tmp_path.parent / "glm-video-ref"))
    srv = start_server(model_dir, tmp_path, mode, "--max-num-batched-tokens", "16")
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        for case in CASES:
            prompt, prompt_logprobs, tokens, tops = expected[case]
            r = client.chat.completions.create(
                model=model, messages=CHATS[case][0], max_tokens=NUM_TOKENS, temperature=0, logprobs=True,
                top_logprobs=TOP, extra_body={"prompt_logprobs": 1, "return_token_ids": True, "ignore_eos": True})
            choice = r.choices[0]
            assert r.model_extra["prompt_token_ids"] == prompt, case
            steps = r.model_extra["prompt_logprobs"]
            assert steps[0] is None and len(steps) == len(prompt), case
            for i in range(1, len(prompt)):
                assert abs(steps[i][str(prompt[i])]["logprob"] - prompt_logprobs[i - 1, prompt[i]].item()) < 1e-4
            assert choice.model_extra["token_ids"] == tokens, case
            served = [[t.logprob for t in step.top_logprobs] for step in choice.logprobs.content]
            torch.testing.assert_close(served, tops, atol=1e-4, rtol=0)
        if with_video:
            r = client.chat.completions.create(
                model=model, messages=_video_chat()[0], max_tokens=NUM_TOKENS, temperature=0, logprobs=True,
                top_logprobs=TOP, extra_body={"return_token_ids": True, "ignore_eos": True})
            assert r.model_extra["prompt_token_ids"] == video_prompt
            assert r.choices[0].model_extra["token_ids"] == video_tokens
            served = [[t.logprob for t in step.top_logprobs] for step in r.choices[0].logprobs.content]
            torch.testing.assert_close(served, [[v for _, v in top] for top in video_tops], atol=1e-4, rtol=0)
    finally:
        assert srv.stop() == 0, srv.log()
    assert not srv.group_alive(), "a server process survived Ctrl-C"
