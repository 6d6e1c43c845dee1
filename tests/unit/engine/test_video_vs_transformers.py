"""Video through the offline LLM (`LLM.chat` with `video_url` parts: header
plan, PyAV decode, our preprocessing, the vision tower with t > 1, the
prompt's timestamps or one run of pads, M-RoPE video positions, deepstack)
equals transformers in float32: its own processor (Qwen3VLProcessor /
Qwen2_5_VLProcessor, in a child process with torchvision) on the same decoded
frames and its own model. Checked: prompt token ids, the greedy tokens, and
the top-5 logprobs at each generated token (a tiny random model says nearly
the same text for any video, and its chosen token's logprob is ~0 whatever the
video: the runners-up's logprobs are what a wrong frame, order, attention
span, fps or position moves)."""
from __future__ import annotations

import pytest
import torch

from epd.encoders.video_io import decode_frames, read_video_meta
from epd.tools.make_model import make_model
from epd.transport.wire.sampling import SamplingParams
from testkit.family_checkpoints import family_checkpoint
from testkit.hf_reference import _load, hf_greedy_logprobs, hf_inputs
from testkit.media import IMG_A, image_part
from testkit.video_reference import VideoClips, reference_available
from testkit.videos import encode_video, synthetic_frames

pytest.importorskip("av")
pytestmark = pytest.mark.skipif(not reference_available(), reason="scripts/env.sh dev installs the reference")

NUM_TOKENS = 6
TOP = 5


@pytest.fixture(scope="module")
def qwen25_model(tmp_path_factory) -> str:
    return str(make_model(tmp_path_factory.mktemp("ckpt") / "qwen25", preset="qwen2.5-vl-tiny", seed=3))


def _hf_greedy_logprobs(model_dir, messages, images, videos) -> tuple[list[int], list[int], list[list], torch.Tensor]:
    """(prompt ids, greedy tokens, each step's top-5 (token, logprob), video grids) by transformers,
    one full forward per token."""
    model, _, _ = _load(model_dir)
    inputs = hf_inputs(model_dir, messages, images, videos)
    return (*hf_greedy_logprobs(model, inputs, NUM_TOKENS, TOP), inputs["video_grid_thw"])


def _video_part(path) -> dict:
    return {"type": "video_url", "video_url": {"url": f"file://{path}"}}


# (checkpoint, videos as (container, frames (n, height, width)), transformers' kwargs, ours, with an image)
CASES = {
    "qwen3_text_video": ("tiny", [("mp4", (11, 64, 96))], {}, None, False),  # 2 fps of 5: 4 frames, 2 groups
    "qwen3_image_video": ("tiny", [("mkv", (9, 48, 64))], {"num_frames": 6, "fps": None}, {"num_frames": 6}, True),
    # video, image, video: spans of both videos' groups in prompt order around the image's
    "qwen3_two_videos": ("tiny", [("mp4", (11, 64, 96)), ("webm", (8, 48, 64))], {}, None, True),
    # Qwen3-VL-MoE with odd shapes: a 7x7 position table, one deepstack layer, padded vocabulary
    "qwen3_moe_image_video": ("qwen3_vl_moe", [("mp4", (11, 64, 96))], {}, None, True),
    "qwen25_text_video": ("qwen25", [("mp4", (7, 64, 96))], {}, None, False),  # every frame: 4 groups, 2 windows
    "qwen25_image_video": ("qwen25", [("mkv", (11, 48, 64))], {"do_sample_frames": True, "fps": 2},
                           {"do_sample_frames": True, "fps": 2}, True),
}


ON_GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs a CUDA GPU")])


@pytest.mark.parametrize("device", ["cpu", ON_GPU])  # cuda: the towers and the engine on the GPU
@pytest.mark.parametrize("case", list(CASES))
def test_llm_chat_with_video_equals_transformers(case, device, tiny_model, qwen25_model, tmp_path):
    from epd import LLM

    preset, clips, hf_kwargs, ours, with_image = CASES[case]
    model_dir = {"tiny": tiny_model, "qwen25": qwen25_model}.get(preset) or family_checkpoint(preset)
    videos = [encode_video(synthetic_frames(n, height, width, seed=len(case) + i), kind, fps=5)
              for i, (kind, (n, height, width)) in enumerate(clips)]
    parts = []
    for i, ((kind, _), data) in enumerate(zip(clips, videos)):
        path = tmp_path / f"clip{i}.{kind}"
        path.write_bytes(data)
        parts.append(_video_part(path))
    if with_image:
        parts.insert(1 if len(parts) > 1 else 0, image_part(IMG_A))
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": "What happens?"}]}]

    metas = [read_video_meta(data) for data in videos]
    clips = VideoClips([(decode_frames(data, range(meta.num_frames)), meta) for data, meta in zip(videos, metas)],
                       hf_kwargs, tmp_path / "ref")
    ref_prompt, ref_tokens, ref_logprobs, ref_grids = _hf_greedy_logprobs(
        model_dir, messages, [IMG_A] if with_image else [], clips)

    # a token budget that prefills in chunks across the video
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=64, device=device)
    [out] = llm.chat(messages, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=TOP),
                     mm_processor_kwargs=ours)
    assert out.prompt_token_ids == ref_prompt
    assert out.outputs[0].token_ids == ref_tokens
    tops = [lp.top for lp in out.outputs[0].logprobs]
    assert [[t for t, _ in top] for top in tops] == [[t for t, _ in top] for top in ref_logprobs]
    torch.testing.assert_close([[v for _, v in top] for top in tops], [[v for _, v in top] for top in ref_logprobs],
                               atol=1e-4, rtol=0)
    video_pad = llm.engine.info.video_token_id
    assert ref_prompt.count(video_pad) == sum(int(g.prod()) // 4 for g in ref_grids)
