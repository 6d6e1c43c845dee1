"""Video through the offline LLM (`LLM.chat` with `video_url` parts: header
plan, PyAV decode, our preprocessing, the vision tower with t > 1, the
prompt's timestamps or one run of pads, M-RoPE video positions, deepstack)
equals transformers in float32: its own processor (Qwen3VLProcessor /
Qwen2_5_VLProcessor, in a child process with torchvision) on the same decoded
frames and its own model. Checked: prompt token ids, the greedy tokens, and
each token's logprob (a tiny random model says nearly the same text for any
video; a wrong frame order, fps or position moves the logprobs)."""
from __future__ import annotations

import pytest
import torch

from epd.encoders.video_io import decode_frames, read_video_meta
from epd.tools.make_model import make_model
from epd.transport.sampling import SamplingParams
from testkit.hf_reference import _load, _mm_token_types, hf_inputs
from testkit.media import IMG_A, image_part
from testkit.video_reference import hf_video_prompt_inputs, reference_available
from testkit.videos import encode_video, synthetic_frames

pytest.importorskip("av")
pytestmark = pytest.mark.skipif(not reference_available(), reason="scripts/env.sh dev installs the reference")

NUM_TOKENS = 6


@pytest.fixture(scope="module")
def qwen25_model(tmp_path_factory) -> str:
    return str(make_model(tmp_path_factory.mktemp("ckpt") / "qwen25", preset="qwen2.5-vl-tiny", seed=3))


@torch.no_grad()
def _hf_greedy_logprobs(model_dir, messages, images, videos) -> tuple[list[int], list[int], list[float]]:
    """(prompt ids, greedy tokens, each token's logprob) by transformers, one full forward per token."""
    model, _, _ = _load(model_dir)
    inputs = hf_inputs(model_dir, messages, images, videos)
    ids = inputs["input_ids"]
    prompt, tokens, logprobs = ids[0].tolist(), [], []
    for _ in range(NUM_TOKENS):
        logits = model(**dict(inputs, input_ids=ids, mm_token_type_ids=_mm_token_types(model, ids))).logits[0, -1]
        token = int(logits.argmax())
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits.float(), -1)[token]))
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return prompt, tokens, logprobs


def _video_part(path) -> dict:
    return {"type": "video_url", "video_url": {"url": f"file://{path}"}}


# (checkpoint, container, frames (n, height, width), transformers' kwargs, ours, with an image)
CASES = {
    "qwen3_text_video": ("tiny", "mp4", (11, 64, 96), {}, None, False),  # 2 fps of 5: 4 frames, 2 groups
    "qwen3_image_video": ("tiny", "mkv", (9, 48, 64), {"num_frames": 6, "fps": None}, {"num_frames": 6}, True),
    "qwen25_text_video": ("qwen25", "mp4", (7, 64, 96), {}, None, False),  # every frame: 4 groups, 2 windows
    "qwen25_image_video": ("qwen25", "mkv", (11, 48, 64), {"do_sample_frames": True, "fps": 2},
                           {"do_sample_frames": True, "fps": 2}, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_llm_chat_with_video_equals_transformers(case, tiny_model, qwen25_model, tmp_path):
    from epd import LLM

    preset, kind, (n, height, width), hf_kwargs, ours, with_image = CASES[case]
    model_dir = tiny_model if preset == "tiny" else qwen25_model
    data = encode_video(synthetic_frames(n, height, width, seed=len(case)), kind, fps=5)
    path = tmp_path / f"clip.{kind}"
    path.write_bytes(data)
    content = [_video_part(path), {"type": "text", "text": "What happens?"}]
    if with_image:
        content.insert(0, image_part(IMG_A))
    messages = [{"role": "user", "content": content}]

    meta = read_video_meta(data)
    [ref_video] = hf_video_prompt_inputs(model_dir, [(decode_frames(data, range(meta.num_frames)), meta, hf_kwargs)],
                                         tmp_path / "ref")
    ref_prompt, ref_tokens, ref_logprobs = _hf_greedy_logprobs(
        model_dir, messages, [IMG_A] if with_image else [], [ref_video])

    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=64)  # prefill in chunks across the video
    [out] = llm.chat(messages, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0),
                     mm_processor_kwargs=ours)
    assert out.prompt_token_ids == ref_prompt
    assert out.outputs[0].token_ids == ref_tokens
    torch.testing.assert_close([lp.logprob for lp in out.outputs[0].logprobs], ref_logprobs, atol=1e-4, rtol=0)
    video_pad = llm.engine.info.video_token_id
    assert ref_prompt.count(video_pad) == int(ref_video["video_grid_thw"].prod()) // 4  # the video is in the prompt
