"""Per-request video kwargs bounded before any work (issue 44, items 1 and 3): a
request's num_frames within the video's frames and the checkpoint's max_frames,
min/max_pixels within the server's pixel budget, a temporal group's frame within
the image budget; values like 10**30 refused with a reason, never a crash; and a
prompt's length found from the plans' arithmetic before any placeholder is written."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from epd.transport.media.image_geometry import ImageGeometry
from epd.transport.media.video_geometry import VideoGeometry, VideoOptions, VideoPlan
from epd.inputs.prompt import PromptBuilder, PromptTooLong, VideoRef
from epd.inputs.video_header import VideoError, VideoKwargsRefused, plan_video
from epd.families.qwen_vl.presets import PRESETS, write_processor_configs
from epd.families.qwen_vl.prompt_format import QWEN_VL_FORMAT
from testkit.videos import encode_video, synthetic_frames

pytest.importorskip("av")
CLIP = encode_video(synthetic_frames(9, 64, 64, seed=3), "mp4", fps=4)  # 9 frames of 64x64
IMAGE_BUDGET = 256 * 256  # the tiny preset's image max_pixels


@pytest.fixture(scope="module")
def geometry(tmp_path_factory) -> VideoGeometry:
    """The tiny Qwen3-VL preset's video rules: the releases' 25,165,824-pixel budget."""
    directory = tmp_path_factory.mktemp("tiny-configs")
    write_processor_configs(directory, PRESETS["tiny"])
    return VideoGeometry.from_pretrained(directory)


def _plan(geometry, kwargs: dict, server: dict | None = None):
    request, options = VideoOptions.from_kwargs(kwargs), VideoOptions.from_kwargs({**(server or {}), **kwargs})
    server = VideoOptions.from_kwargs(server)
    return plan_video(CLIP, geometry, options, max_frames=4096, request=request, server=server,
                      max_group_pixels=IMAGE_BUDGET)


@pytest.mark.parametrize("num_frames", [10, 10**6, 10**30])
def test_num_frames_past_the_video_is_refused_naming_the_range(geometry, num_frames):
    with pytest.raises(VideoKwargsRefused, match=rf"num_frames={num_frames} exceeds what this video of 9 frames allows: 1\.\.9"):
        _plan(geometry, {"num_frames": num_frames})


def test_num_frames_within_the_video_plans_as_before(geometry):
    assert _plan(geometry, {"num_frames": 9})[1].frame_indices == tuple(range(9))
    assert _plan(geometry, {"num_frames": 4})[1].frame_indices == (0, 3, 5, 8)


@pytest.mark.parametrize("key, value", [("min_pixels", 10**15), ("max_pixels", 10**15), ("min_pixels", 25165825)])
def test_pixels_past_the_servers_budget_are_refused(geometry, key, value):
    with pytest.raises(VideoKwargsRefused, match=rf"{key}={value} exceeds this server's video pixel budget: "
                                         r"allowed 1\.\.25165824"):
        _plan(geometry, {key: value})


def test_a_servers_own_budget_bounds_its_requests(geometry):
    with pytest.raises(VideoKwargsRefused, match=r"max_pixels=20000 exceeds this server's video pixel budget: "
                                         r"allowed 1\.\.16384"):
        _plan(geometry, {"max_pixels": 20000}, server={"max_pixels": 16384})
    assert _plan(geometry, {"max_pixels": 16384}, server={"max_pixels": 16384})[1].resized_height == 64


def test_upscaling_past_the_image_budget_is_refused(geometry):
    """min_pixels 8294400 upscaled a 64x64 clip to 1440x1440 a frame: within the video
    budget, but each group's frame is then larger than one image may be."""
    with pytest.raises(VideoKwargsRefused, match=r"resize the video's frames to 1440x1440, past this server's limit "
                                         r"of 65536 pixels a frame"):
        _plan(geometry, {"min_pixels": 8294400})
    assert _plan(geometry, {"min_pixels": 4 * 256 * 256})[1].resized_height == 256  # up to the image budget


def test_the_servers_own_plan_is_never_refused(geometry):
    """A group larger than the image budget that the server's settings give anyway (the
    tiny preset's video budget is the release's, its images' far less) is served."""
    clip = encode_video(synthetic_frames(4, 400, 400, seed=1), "mp4", fps=4)
    request = VideoOptions()
    _, plan = plan_video(clip, geometry, request, request=request, max_group_pixels=IMAGE_BUDGET)
    assert plan.resized_height * plan.resized_width > IMAGE_BUDGET


@pytest.mark.parametrize("fps", [1e308, 10**30])
def test_huge_fps_takes_every_frame(geometry, fps):
    assert _plan(geometry, {"fps": fps})[1].frame_indices == tuple(range(9))


@pytest.mark.parametrize("bad", [{"fps": float("inf")}, {"fps": float("nan")}])
def test_fps_must_be_finite(bad):
    with pytest.raises(ValueError, match="fps must be a positive number, got (inf|nan)"):
        VideoOptions.from_kwargs(bad)


def test_servers_num_frames_past_every_bound_is_refused_before_sampling(geometry):
    """np.linspace never gets an uncapped count, whoever set it."""
    with pytest.raises(VideoError, match="cannot sample 1000000 frames from a video of 9"):
        plan_video(CLIP, geometry, VideoOptions(num_frames=10**6))


def test_prompt_length_comes_from_the_plan_before_expansion(tiny_model):
    """A plan of 2,000,000 placeholder tokens is refused from its arithmetic: no
    2,000,000-pad text is written or tokenized."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    builder = PromptBuilder(tokenizer, ImageGeometry.from_pretrained(tiny_model),
                            tokenizer.convert_tokens_to_ids("<|image_pad|>"), prompt_format=QWEN_VL_FORMAT)
    plan = VideoPlan(frame_indices=(0, 1), resized_height=32, resized_width=32, grid_thw=(1, 2, 2),
                     num_tokens=2_000_000, tokens_per_group=2_000_000, group_timestamps_s=(0.0,))
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}},
                                             {"type": "text", "text": "What happens?"}]}]
    with pytest.raises(PromptTooLong, match=r"more than 4096 tokens \(its images and videos take 2000000\)"):
        builder.build(messages, [], max_tokens=4096, videos=[VideoRef(plan, "1" * 64)])


@pytest.mark.parametrize("kwargs, num_sampled", [
    ({"do_sample_frames": True, "fps": 1e308, "min_frames": 10**30}, 8),  # whole temporal groups of the 9
    ({"do_sample_frames": True, "fps": 1, "max_frames": 10**30}, 4),  # 2.25 s at 1 fps, raised to min_frames
    ({"do_sample_frames": True, "num_frames": 10**30}, None)])
def test_qwen2_extremes_plan_or_refuse_with_a_reason(tmp_path, kwargs, num_sampled):
    """Qwen2.5-VL's rules under values no client means: every frame, or a 400, never a crash."""
    write_processor_configs(tmp_path, PRESETS["qwen2.5-vl-tiny"])
    geometry = VideoGeometry.from_pretrained(tmp_path)
    request = VideoOptions.from_kwargs(kwargs)
    if num_sampled is None:
        with pytest.raises(VideoKwargsRefused, match="num_frames=10+ exceeds what this video of 9 frames allows"):
            plan_video(CLIP, geometry, request, request=request, max_group_pixels=IMAGE_BUDGET)
        return
    _, plan = plan_video(CLIP, geometry, request, request=request, max_group_pixels=IMAGE_BUDGET)
    assert len(plan.frame_indices) == num_sampled
