"""Prompts as the release's own processor builds them (issue 44 item 7): for each
family, chat messages with videos and images rendered through the release's
chat template (tests/testkit/release_templates.py) by EPD's PromptBuilder (the
videos planned from their headers) give the token ids transformers' whole
processor gives on the whole chat text: Qwen3-VL's template wrapper around a
video replaced by the per-group `<t seconds><|vision_start|>...<|vision_end|>`,
Qwen2.5-VL's kept around one run of pads. Token ids only: no model runs."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from epd.transport.media.image_geometry import ImageGeometry
from epd.transport.media.video_geometry import VideoGeometry, VideoOptions
from epd.encoders.video_io import decode_frames, read_video_meta
from epd.inputs.prompt import ImageRef, PromptBuilder, VideoRef
from epd.inputs.video_header import plan_video
from epd.tools.make_model import make_model
from epd.families.qwen_vl.prompt_format import QWEN_VL_FORMAT
from testkit.family_checkpoints import family_checkpoint
from testkit.media import IMG_A, IMG_B, image_part
from testkit.release_templates import BY_MODEL_TYPE
from testkit.video_reference import VideoClips, hf_processor_inputs, reference_available
from testkit.videos import encode_video, synthetic_frames

pytest.importorskip("av")
pytestmark = pytest.mark.skipif(not reference_available(), reason="scripts/env.sh dev installs the reference")

CLIPS = [encode_video(synthetic_frames(11, 64, 96, seed=1), "mp4", fps=5),
         encode_video(synthetic_frames(8, 48, 64, seed=2), "webm", fps=4)]
VIDEO_PART = {"type": "video_url", "video_url": {"url": "file:///unused.mp4"}}
# a system turn, then video, image, text, video, image; one answer, a second question with a video
MESSAGES = [
    {"role": "system", "content": "You describe videos."},
    {"role": "user", "content": [VIDEO_PART, image_part(IMG_A), {"type": "text", "text": "And then?"},
                                 VIDEO_PART, image_part(IMG_B)]},
    {"role": "assistant", "content": "A box moves."},
    {"role": "user", "content": [{"type": "text", "text": "Again:"}, VIDEO_PART]},
]
VIDEOS = [CLIPS[0], CLIPS[1], CLIPS[0]]  # in part order
IMAGES = [IMG_A, IMG_B]
WRAPPER = "<|vision_start|><|video_pad|><|vision_end|>"
# (checkpoint, model_type, chat_template_kwargs, template: the release's, or one writing a bare pad)
CASES = {
    "qwen3_vl": ("tiny", "qwen3_vl", {}, BY_MODEL_TYPE["qwen3_vl"]),
    # "Video 1: " before the wrapper
    "qwen3_vl_vision_ids": ("tiny", "qwen3_vl", {"add_vision_id": True}, BY_MODEL_TYPE["qwen3_vl"]),
    "qwen3_vl_moe": ("qwen3_vl_moe", "qwen3_vl_moe", {}, BY_MODEL_TYPE["qwen3_vl_moe"]),
    "qwen2_5_vl": ("qwen25", "qwen2_5_vl", {"add_vision_id": True}, BY_MODEL_TYPE["qwen2_5_vl"]),
    # a custom template without the wrapper: the processor writes the groups alone, nothing is taken away
    "qwen3_vl_bare_pad": ("tiny", "qwen3_vl", {}, BY_MODEL_TYPE["qwen3_vl"].replace(WRAPPER, "<|video_pad|>")),
}


@pytest.fixture(scope="module")
def qwen25_model(tmp_path_factory) -> str:
    return str(make_model(tmp_path_factory.mktemp("ckpt") / "qwen25", preset="qwen2.5-vl-tiny", seed=3))


@pytest.mark.parametrize("case", list(CASES))
def test_release_template_prompt_equals_transformers_processor(case, tiny_model, qwen25_model, tmp_path):
    checkpoint, model_type, template_kwargs, template = CASES[case]
    model_dir = {"tiny": tiny_model, "qwen25": qwen25_model}.get(checkpoint) or family_checkpoint(checkpoint)
    wrapped = WRAPPER in template
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    builder = PromptBuilder(tokenizer, ImageGeometry.from_pretrained(model_dir),
                            tokenizer.convert_tokens_to_ids("<|image_pad|>"), template, prompt_format=QWEN_VL_FORMAT)
    geometry = VideoGeometry.from_pretrained(model_dir)
    plans = [plan_video(data, geometry, VideoOptions())[1] for data in VIDEOS]
    assert bool(plans[0].group_timestamps_s) == (model_type != "qwen2_5_vl")
    sizes = [(100, 60), (37, 150)]  # IMG_A, IMG_B
    prompt = builder.build(MESSAGES, [ImageRef(w, h, str(i) * 64) for i, (w, h) in enumerate(sizes)],
                           template_kwargs=template_kwargs,
                           videos=[VideoRef(plan, str(i + 2) * 64) for i, plan in enumerate(plans)])

    text = builder.render(MESSAGES, template_kwargs=template_kwargs)
    assert text.count(WRAPPER) == (3 if wrapped else 0)  # the release's wrapper, each video
    metas = [read_video_meta(data) for data in VIDEOS]
    clips = VideoClips([(decode_frames(data, range(meta.num_frames)), meta) for data, meta in zip(VIDEOS, metas)],
                       {}, tmp_path / "ref")
    ref = hf_processor_inputs(model_dir, text, clips, IMAGES)
    ref_ids = ref["input_ids"][0].tolist()
    assert prompt.token_ids == ref_ids
    vision_start = tokenizer.convert_tokens_to_ids("<|vision_start|>")
    groups = sum(int(g[0]) for g in ref["video_grid_thw"])
    wrappers = 2 + (groups if model_type != "qwen2_5_vl" else 3)  # images' + each group's or each video's
    assert ref_ids.count(vision_start) == wrappers
    assert [s.meta["grid_thw"] for s in prompt.mm_spans if s.mm_hash in ("0" * 64, "1" * 64)] == \
        [tuple(int(v) for v in g) for g in ref["image_grid_thw"]]
