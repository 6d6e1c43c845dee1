"""A video's placeholders in the prompt (epd/inputs/prompt.py) and its M-RoPE
positions (epd/families/qwen_vl/mrope.py): Qwen3-VL's `<t seconds>` + vision_start +
pads + vision_end per temporal group, one span per group; Qwen2.5-VL's one run
with its temporal step on the span; positions equal to transformers'
get_rope_index on the same token ids and grids."""
from __future__ import annotations

import functools
import types

import pytest
import torch
from transformers import AutoTokenizer

from epd.transport.media.image_geometry import ImageGeometry
from epd.families.qwen_vl.prompt_format import QWEN_VL_FORMAT
from epd.transport.media.video_geometry import VideoPlan
from epd.transport.media.video_keys import group_mm_hash
from epd.families.qwen_vl.mrope import mrope_positions
from epd.inputs.prompt import ImageRef, PromptBuilder, VideoRef
from epd.transport.wire.mm_span import MMSpan

H1, H2, H3 = "1" * 64, "2" * 64, "3" * 64
# 4 frames of 64x96 -> 2 temporal groups of 4x6 patches (6 tokens each), timestamps as Qwen3VLProcessor's
QWEN3_PLAN = VideoPlan(frame_indices=(0, 3, 7, 10), resized_height=64, resized_width=96, grid_thw=(2, 4, 6),
                       num_tokens=12, tokens_per_group=6, group_timestamps_s=(0.3, 1.7))
# 7 frames -> 4 groups of 4x6 patches, 2 / 5 fps per group
QWEN25_PLAN = VideoPlan(frame_indices=tuple(range(7)), resized_height=56, resized_width=84, grid_thw=(4, 4, 6),
                        num_tokens=24, tokens_per_group=6, second_per_grid_t=0.4)
VIDEO = {"type": "video_url", "video_url": {"url": "file:///x.mp4"}}
IMAGE = {"type": "image_url", "image_url": {"url": "data:,"}}


def test_qwen3_placeholder_text_writes_each_group_with_its_time():
    pads = "<|video_pad|>" * 6
    assert QWEN_VL_FORMAT.expand_video(QWEN3_PLAN, "<|video_pad|>") == (
        f"<0.3 seconds><|vision_start|>{pads}<|vision_end|><1.7 seconds><|vision_start|>{pads}<|vision_end|>")
    assert QWEN_VL_FORMAT.expand_video(QWEN25_PLAN, "<|video_pad|>") == "<|video_pad|>" * 24


@pytest.fixture(scope="module")
def builder(tiny_model) -> PromptBuilder:
    return PromptBuilder(AutoTokenizer.from_pretrained(tiny_model), ImageGeometry.from_pretrained(tiny_model),
                         AutoTokenizer.from_pretrained(tiny_model).convert_tokens_to_ids("<|image_pad|>"),
                         prompt_format=QWEN_VL_FORMAT)


def _messages(*parts) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What happens?"}]}]


def test_qwen3_video_is_one_span_per_group_between_image_spans(builder):
    image = ImageRef(64, 64, H1)
    prompt = builder.build(_messages(IMAGE, VIDEO, IMAGE), [image, ImageRef(64, 64, H3)],
                           videos=[VideoRef(QWEN3_PLAN, H2)])
    spans = prompt.mm_spans
    assert [s.mm_hash for s in spans] == [H1, group_mm_hash(H2, 0), group_mm_hash(H2, 1), H3]
    assert [s.meta["grid_thw"] for s in spans[1:3]] == [(1, 4, 6), (1, 4, 6)] and all(s.length == 6 for s in spans[1:3])
    assert len({group_mm_hash(H2, 0), group_mm_hash(H2, 1), group_mm_hash(H1, 0)}) == 3
    between = builder.tokenizer.decode(prompt.token_ids[spans[1].end:spans[2].offset])
    assert between == "<|vision_end|><1.7 seconds><|vision_start|>"
    assert {prompt.token_ids[i] for s in spans[1:3] for i in range(s.offset, s.end)} == {builder.video_token_id}


def test_qwen25_video_is_one_span_carrying_its_temporal_step(builder):
    prompt = builder.build(_messages(VIDEO), [], videos=[VideoRef(QWEN25_PLAN, H2)])
    [span] = prompt.mm_spans
    assert (span.mm_hash, span.meta["grid_thw"], span.length, span.meta["second_per_grid_t"]) == (H2, (4, 4, 6), 24, 0.4)
    assert MMSpan.from_list(span.to_list()) == span and len(span.to_list()[3]) == 2
    image_span = MMSpan(3, 4, H1, {"grid_thw": (1, 4, 4)})
    assert image_span.to_list() == [3, 4, H1, {"grid_thw": [1, 4, 4]}]  # an image's metadata: its grid alone
    for bad in (float("nan"), float("inf"), "0.4", True):  # the wire checks types; a value's range is Qwen's
        with pytest.raises(ValueError, match="bad mm span"):
            MMSpan.from_list([3, 4, H1, {"grid_thw": [1, 4, 4], "second_per_grid_t": bad}])


def test_video_count_must_match_the_template(builder):
    with pytest.raises(ValueError, match="rendered 1 videos, 0 were given"):
        builder.build(_messages(VIDEO), [])


def _hf_rope_index(family: str, tokens_per_second: int = 4):
    """transformers' get_rope_index (5.x), bound to a stand-in holding only what it reads."""
    if family == "qwen3_vl":
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel as cls
    else:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel as cls
    vision = types.SimpleNamespace(spatial_merge_size=2, tokens_per_second=tokens_per_second)
    stub = types.SimpleNamespace(config=types.SimpleNamespace(vision_config=vision))
    stub.get_vision_position_ids = functools.partial(cls.get_vision_position_ids, stub)
    return functools.partial(cls.get_rope_index, stub)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl"])
def test_positions_equal_transformers_get_rope_index(builder, family):
    plan = QWEN3_PLAN if family == "qwen3_vl" else QWEN25_PLAN
    prompt = builder.build(_messages(IMAGE, VIDEO, IMAGE), [ImageRef(64, 96, H1), ImageRef(96, 64, H3)],
                           videos=[VideoRef(plan, H2)])
    ids = torch.tensor([prompt.token_ids])
    image_id = builder.image_token_id
    types_ = (ids == image_id).int() + 2 * (ids == builder.video_token_id).int()
    image_grids = torch.tensor([s.meta["grid_thw"] for s in prompt.mm_spans if prompt.token_ids[s.offset] == image_id])
    extra = {} if family == "qwen3_vl" else {"second_per_grid_ts": torch.tensor([plan.second_per_grid_t])}
    ref, ref_delta = _hf_rope_index(family)(ids, types_, image_grid_thw=image_grids,
                                            video_grid_thw=torch.tensor([plan.grid_thw]), **extra)
    positions, delta = mrope_positions(len(prompt.token_ids), prompt.mm_spans, 2, tokens_per_second=4)
    assert torch.equal(positions, ref[:, 0]) and delta == int(ref_delta)
    if family == "qwen2_5_vl":  # 0.4 s x 4 tokens/s: groups at 0, 1, 3, 4 past the video's start
        [video] = [s for s in prompt.mm_spans if s.meta.get("second_per_grid_t")]
        start = int(positions[1, video.offset])
        assert positions[0, video.offset:video.end:6].tolist() == [start, start + 1, start + 3, start + 4]


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl"])
def test_a_video_cut_into_chunks_keeps_its_tokens_and_positions(builder, family):
    """--video-chunk-frames: the same prompt tokens and M-RoPE positions (so transformers'),
    Qwen3-VL's spans unchanged, Qwen2.5-VL's one run cut into one span per chunk, each
    continuing the video's temporal positions (`first_group`), each keyed by its range."""
    from epd.transport.media.video_chunks import split_plan
    from epd.transport.media.video_keys import chunk_mm_hash

    plan = QWEN3_PLAN if family == "qwen3_vl" else QWEN25_PLAN
    chunks = tuple(split_plan(plan, temporal_patch_size=2, chunk_frames=2))  # one group a chunk
    assert len(chunks) == plan.grid_thw[0]
    whole, cut = (builder.build(_messages(IMAGE, VIDEO, IMAGE), [ImageRef(64, 96, H1), ImageRef(96, 64, H3)],
                                videos=[VideoRef(plan, H2, c)]) for c in ((), chunks))
    assert cut.token_ids == whole.token_ids
    assert torch.equal(mrope_positions(len(cut.token_ids), cut.mm_spans, 2, tokens_per_second=4)[0],
                       mrope_positions(len(whole.token_ids), whole.mm_spans, 2, tokens_per_second=4)[0])
    assert mrope_positions(len(cut.token_ids), cut.mm_spans, 2, 4)[1] == \
        mrope_positions(len(whole.token_ids), whole.mm_spans, 2, 4)[1]
    if family == "qwen3_vl":
        assert cut.mm_spans == whole.mm_spans
        return
    video = cut.mm_spans[1:-1]
    assert [(s.mm_hash, s.meta["grid_thw"], s.meta.get("first_group", 0)) for s in video] == \
        [(chunk_mm_hash(H2, g, g + 1), (1, 4, 6), g) for g in range(4)]
    assert video[0].offset == whole.mm_spans[1].offset and video[-1].end == whole.mm_spans[1].end
    assert all(a.end == b.offset for a, b in zip(video, video[1:]))
    assert [MMSpan.from_list(s.to_list()) for s in video] == video and len(video[1].to_list()[3]) == 3
    for bad in (True, "1", [1.0], None):  # the wire checks types; a value's range is Qwen's
        with pytest.raises(ValueError, match="bad mm span"):
            MMSpan.from_list([3, 6, H1, {"grid_thw": [1, 4, 6], "second_per_grid_t": 0.4, "first_group": bad}])


def test_split_plan_cuts_whole_groups():
    from epd.transport.media.video_chunks import split_plan

    assert split_plan(QWEN25_PLAN, 2, 0) == [QWEN25_PLAN] == split_plan(QWEN25_PLAN, 2, 8)  # off; fits in one
    chunks = split_plan(QWEN25_PLAN, 2, 5)  # 5 frames: 2 groups a chunk
    assert [c.frame_indices for c in chunks] == [(0, 1, 2, 3), (4, 5, 6)]  # the last group: one frame, repeated
    assert [(c.grid_thw, c.num_tokens, c.first_group, c.total_groups) for c in chunks] == \
        [((2, 4, 6), 12, 0, 4), ((2, 4, 6), 12, 2, 4)]
    three = split_plan(QWEN3_PLAN, 2, 1)  # fewer frames than a group: a group a chunk
    assert [c.group_timestamps_s for c in three] == [(0.3,), (1.7,)]


def test_where_a_video_holds_the_image_token_the_placeholders_order_tells_the_runs_apart():
    """GLM-4.1V: a video's groups are runs of `<|image|>` like an image's; image, video, image
    give the first image's span, the video's two group spans, then the second image's, whatever
    token id config.json names for video (`<|video|>`: never in the expanded prompt)."""
    from testkit.family_checkpoints import family_checkpoint

    from epd.families.glm4v.prompt_format import GLM4V_FORMAT, Glm4vImageGeometry

    model_dir = family_checkpoint("glm4v")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    glm = PromptBuilder(tokenizer, Glm4vImageGeometry.from_pretrained(model_dir),
                        tokenizer.convert_tokens_to_ids("<|image|>"),
                        video_token_id=tokenizer.convert_tokens_to_ids("<|video|>"), prompt_format=GLM4V_FORMAT)
    plan = VideoPlan(frame_indices=(0, 3, 5, 8), resized_height=56, resized_width=84, grid_thw=(2, 4, 6),
                     num_tokens=12, tokens_per_group=6, group_timestamps_s=(0.0, 1.0))
    image = ImageRef(56, 56, H1)
    per_image = glm.geometry.num_image_tokens(56, 56)
    prompt = glm.build(_messages(IMAGE, VIDEO, IMAGE), [image, ImageRef(56, 56, H3)], videos=[VideoRef(plan, H2)])
    spans = prompt.mm_spans
    assert [s.mm_hash for s in spans] == [H1, group_mm_hash(H2, 0), group_mm_hash(H2, 1), H3]
    assert [s.length for s in spans] == [per_image, 6, 6, per_image]
    assert [s.meta["grid_thw"] for s in spans[1:3]] == [(1, 4, 6), (1, 4, 6)]
    assert glm.tokenizer.decode(prompt.token_ids[spans[1].end:spans[2].offset]) == "<|end_of_image|>0<|begin_of_image|>"
    video_first = glm.build(_messages(VIDEO, IMAGE), [image], videos=[VideoRef(plan, H2)]).mm_spans
    assert [s.mm_hash for s in video_first] == [group_mm_hash(H2, 0), group_mm_hash(H2, 1), H1]
