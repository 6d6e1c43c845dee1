"""GLM-4.1V's video plan against transformers' Glm4vVideoProcessor and
Glm4vProcessor: the frames it samples, the size and grid it gives them, the
times its prompt writes; and the encoder's patch order against its patchify."""
from __future__ import annotations

import tempfile

import pytest
import torch

from epd.families.glm4v.prompt_format import GLM4V_FORMAT
from epd.families.glm4v.video_geometry import Glm4vVideoGeometry
from epd.transport.media.video_geometry import VideoGeometry, VideoMeta, VideoOptions, VideoPlanError

transformers = pytest.importorskip("transformers")

RELEASE = {"size": {"shortest_edge": 12544, "longest_edge": 47040000}, "patch_size": 14, "temporal_patch_size": 2,
           "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
           "image_std": [0.26862954, 0.26130258, 0.27577711], "video_processor_type": "Glm4vVideoProcessor"}
# (frames, fps, width, height): one frame, a few, 10 s, an odd rate, past max_duration (spread; or every frame)
VIDEOS = [(1, 30.0, 64, 48), (3, 30.0, 640, 360), (300, 30.0, 1280, 720), (95, 29.97, 320, 240),
          (10000, 25.0, 480, 270), (700, 1.0, 200, 100), (350, 1.0, 100, 200), (61, 0.5, 20, 300)]


def _processor(**attrs):
    """transformers' Glm4vVideoProcessor without its __init__, which needs torchvision (not
    installed); sample_frames and patchify read only the class settings set here."""
    from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor

    processor = Glm4vVideoProcessor.__new__(Glm4vVideoProcessor)
    for key, value in attrs.items():
        setattr(processor, key, value)
    return processor


def _metadata(frames: int, fps: float):
    from transformers.video_utils import VideoMetadata

    return VideoMetadata(total_num_frames=frames, fps=fps, duration=frames / fps)


@pytest.mark.parametrize("request_fps", [None, 1.0, 4.0])
@pytest.mark.parametrize("video", VIDEOS, ids=[f"{n}@{fps}" for n, fps, _, _ in VIDEOS])
def test_sampled_frames_equal_the_processors(video, request_fps):
    frames, fps, width, height = video
    geometry = Glm4vVideoGeometry.from_config(RELEASE)
    want = _processor().sample_frames(_metadata(frames, fps), fps=request_fps).tolist()
    plan = geometry.plan(VideoMeta(frames, fps, width, height), VideoOptions(fps=request_fps))
    assert list(plan.frame_indices) == want
    assert len(want) % 2 == 0


@pytest.mark.parametrize("size", [RELEASE["size"], {"shortest_edge": 2 * 28 * 28, "longest_edge": 8 * 28 * 28 * 6}],
                         ids=["release", "small"])
@pytest.mark.parametrize("video", VIDEOS, ids=[f"{n}@{fps}" for n, fps, _, _ in VIDEOS])
def test_size_grid_and_prompt_equal_the_processors(video, size):
    from transformers import AutoImageProcessor, Glm4vImageProcessor, Glm4vProcessor
    from transformers.models.glm4v.video_processing_glm4v import smart_resize

    frames, fps, width, height = video
    plan = Glm4vVideoGeometry.from_config({**RELEASE, "size": size}).plan(VideoMeta(frames, fps, width, height))
    n = len(plan.frame_indices)
    want_h, want_w = smart_resize(n, height, width, temporal_factor=2, factor=28,
                                  min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
    assert (plan.resized_height, plan.resized_width) == (want_h, want_w)
    assert plan.grid_thw == (n // 2, want_h // 14, want_w // 14)
    assert plan.num_tokens == plan.grid_thw[0] * plan.tokens_per_group == n // 2 * want_h * want_w // 28 // 28

    # the prompt: Glm4vProcessor.replace_video_token on the sampled frames' metadata and the grid
    with tempfile.TemporaryDirectory() as model_dir:
        Glm4vImageProcessor().save_pretrained(model_dir)
        processor = Glm4vProcessor.__new__(Glm4vProcessor)
        processor.video_processor = AutoImageProcessor.from_pretrained(model_dir)  # its merge_size, 2
    processor.image_token = "<|image|>"
    metadata = _metadata(frames, fps)
    metadata.frames_indices = list(plan.frame_indices)
    want = processor.replace_video_token({"video_grid_thw": torch.tensor([plan.grid_thw]),
                                          "video_metadata": [metadata]}, 0)
    assert GLM4V_FORMAT.expand_video(plan, "<|video|>") == want


def test_every_frame_without_sampling_and_the_last_repeated():
    geometry = Glm4vVideoGeometry.from_config({**RELEASE, "do_sample_frames": False})
    plan = geometry.plan(VideoMeta(7, 30.0, 64, 48))
    assert plan.frame_indices == tuple(range(7)) and plan.grid_thw[0] == 4  # 7 frames, 4 groups
    assert plan.group_timestamps_s == (0.0, 2 / 30, 4 / 30, 6 / 30)
    sampled = geometry.plan(VideoMeta(7, 30.0, 64, 48), VideoOptions(do_sample_frames=True))
    assert sampled.frame_indices == (0, 0)  # 7 / 30 s: one frame at 2 fps, repeated


def test_request_keys_the_processor_ignores_change_nothing():
    """Glm4vVideoProcessor takes a request's fps and do_sample_frames; num_frames,
    min / max_pixels and min / max_frames reach nothing of its plan."""
    geometry = Glm4vVideoGeometry.from_config(RELEASE)
    meta = VideoMeta(300, 30.0, 1280, 720)
    ignored = VideoOptions(num_frames=4, min_pixels=10 ** 8, max_pixels=28 * 28 * 2, min_frames=2, max_frames=4)
    assert geometry.plan(meta, ignored) == geometry.plan(meta)
    assert geometry.plan(meta, VideoOptions(fps=0.5)).frame_indices == (0, 60, 120, 180, 240, 240)


def test_refusals():
    geometry = Glm4vVideoGeometry.from_config(RELEASE)
    for meta, match in [(VideoMeta(0, 30.0, 64, 48), "no frames"), (VideoMeta(10, 30.0, 0, 48), "empty"),
                        (VideoMeta(10, 0.0, 64, 48), "frame rate"), (VideoMeta(10, 30.0, 8, 4000), "aspect ratio")]:
        with pytest.raises(VideoPlanError, match=match):
            geometry.plan(meta)
    with pytest.raises(VideoPlanError, match="at least 2"):
        Glm4vVideoGeometry.from_config({**RELEASE, "do_sample_frames": False}).plan(VideoMeta(1, 30.0, 64, 48))


def test_the_encoders_patch_order_is_the_processors():
    """The encoder preprocesses a video with encoders/video_processor.py (the settings read
    from GLM's config); its patch order equals Glm4vVideoProcessor.patchify's."""
    from epd.encoders.video_processor import patchify

    geometry = VideoGeometry.from_config(RELEASE)
    frames = torch.randn(5, 3, 56, 84, generator=torch.Generator().manual_seed(3))
    ours, grid = patchify(frames, geometry)
    want, t, h, w = _processor().patchify(frames[None], patch_size=14, merge_size=2, temporal_patch_size=2)
    assert grid == (t, h, w) == (3, 4, 6)
    assert torch.equal(ours, want[0])
