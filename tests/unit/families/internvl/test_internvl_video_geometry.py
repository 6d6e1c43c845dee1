"""InternVL's torch-free video plan against transformers' InternVLVideoProcessor
(in a child process with torchvision) on the same decoded frames: the frames it
takes (every one; num_frames or fps sampled from half a step in; what it
refuses) and, from the plan, the encoder's frames (resized whole to one tile,
normalised) equal to its pixel_values_videos; and the ways the plan refuses."""
from __future__ import annotations

import pytest
import torch
from testkit.video_reference import hf_video_outputs, reference_available
from testkit.videos import encode_video, synthetic_frames

from epd.families.internvl.video_geometry import InternVLVideoGeometry
from epd.tools.make_model import make_model
from epd.transport.media.video_geometry import VideoKwargsError, VideoMeta, VideoOptions, VideoPlanError

pytest.importorskip("av")

CALLS = [{}, {"do_sample_frames": True, "num_frames": 4}, {"do_sample_frames": True, "fps": 2},
         {"do_sample_frames": True, "num_frames": 11}, {"do_sample_frames": True, "num_frames": 12}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(make_model(tmp_path_factory.mktemp("internvl"), "internvl-tiny", seed=1))


@pytest.mark.skipif(not reference_available(), reason="scripts/env.sh dev installs the reference")
def test_plans_and_frames_equal_the_video_processors(checkpoint, tmp_path):
    from epd.encoders.video_io import decode_frames, read_video_meta
    from epd.encoders.video_processor import normalize_frames, resize_frames

    data = encode_video(synthetic_frames(11, 48, 80, seed=3), "mp4", fps=5)
    meta = read_video_meta(data)
    frames = decode_frames(data, range(meta.num_frames))
    [results] = hf_video_outputs(checkpoint, [(frames, meta, CALLS)], tmp_path)
    geometry = InternVLVideoGeometry.from_pretrained(checkpoint)
    for kwargs, want in zip(CALLS, results):
        options = VideoOptions.from_kwargs(kwargs)
        if "error" in want:
            with pytest.raises(VideoPlanError, match="cannot sample 12 frames"):
                geometry.plan(meta, options)
            continue
        plan = geometry.plan(meta, options)
        assert list(plan.frame_indices) == want["frames_indices"], kwargs
        assert plan.grid_thw == (len(plan.frame_indices), 8, 8) and plan.tokens_per_group == 16
        chosen = torch.as_tensor(frames[list(plan.frame_indices)]).permute(0, 3, 1, 2).contiguous()
        ours = normalize_frames(resize_frames(chosen, plan.resized_height, plan.resized_width), geometry)
        assert torch.equal(ours, want["pixel_values_videos"][0]), kwargs


def test_refusals():
    geometry = InternVLVideoGeometry.from_config({"size": {"height": 64, "width": 64}}, 16)
    meta = VideoMeta(num_frames=10, fps=5.0, width=80, height=48)
    with pytest.raises(VideoPlanError, match="needs num_frames or fps"):
        geometry.plan(meta, VideoOptions(do_sample_frames=True))
    with pytest.raises(VideoPlanError, match="frame rate"):
        geometry.plan(VideoMeta(10, 0.0, 80, 48), VideoOptions(do_sample_frames=True, fps=2))
    with pytest.raises(VideoKwargsError, match="num_frames=11 exceeds"):
        geometry.check_request(meta, VideoOptions(num_frames=11))
    with pytest.raises(ValueError, match="not a square number"):
        InternVLVideoGeometry.from_config({}, 15)
    assert geometry.plan(meta, VideoOptions(do_sample_frames=True, fps=1)).frame_indices == (2, 7)  # 2 s: 2 frames
