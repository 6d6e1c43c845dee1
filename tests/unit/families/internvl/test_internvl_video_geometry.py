"""InternVL's torch-free video plan: what it refuses, as InternVLVideoProcessor
does, and its fps sampling (its frames against transformers' processor:
test_internvl_video_llm.py)."""
from __future__ import annotations

import pytest

from epd.families.internvl.video_geometry import InternVLVideoGeometry
from epd.transport.media.video_geometry import VideoKwargsError, VideoMeta, VideoOptions, VideoPlanError


def test_refusals():
    geometry = InternVLVideoGeometry.from_config({"size": {"height": 64, "width": 64}}, 16)
    meta = VideoMeta(num_frames=10, fps=5.0, width=80, height=48)
    with pytest.raises(VideoPlanError, match="needs num_frames or fps"):
        geometry.plan(meta, VideoOptions(do_sample_frames=True))
    with pytest.raises(VideoPlanError, match="frame rate"):
        geometry.plan(VideoMeta(10, 0.0, 80, 48), VideoOptions(do_sample_frames=True, fps=2))
    with pytest.raises(VideoPlanError, match="cannot sample 11 frames from a video of 10"):
        geometry.plan(meta, VideoOptions(do_sample_frames=True, num_frames=11))
    with pytest.raises(VideoKwargsError, match="num_frames=11 exceeds"):
        geometry.check_request(meta, VideoOptions(num_frames=11))
    with pytest.raises(ValueError, match="not a square number"):
        InternVLVideoGeometry.from_config({}, 15)
    assert geometry.plan(meta, VideoOptions(do_sample_frames=True, fps=1)).frame_indices == (2, 7)  # 2 s: 2 frames
