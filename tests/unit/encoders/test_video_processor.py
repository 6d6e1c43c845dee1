"""Encoder side of video: the planned frames decoded with PyAV and turned into
`pixel_values_videos` / `video_grid_thw` equal (torch.equal, float32) to
transformers' own video processor given the same decoded frames."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from epd.transport.media.video_geometry import VideoGeometry, VideoOptions
from epd.encoders.video_io import VideoError, decode_frames
from epd.encoders.video_processor import VideoPreprocessor, frame_resizer, resize_frames
from epd.inputs.video_header import plan_video
from epd.families.qwen_vl.presets import PRESETS, write_processor_configs
from testkit.video_reference import hf_video_outputs, reference_available
from testkit.videos import encode_video, synthetic_frames

pytest.importorskip("av")


def test_lossless_decode_returns_the_planned_frames_in_order():
    frames = synthetic_frames(9)
    data = encode_video(frames, "mkv")
    picked = [0, 4, 4, 8, 2]
    assert np.array_equal(decode_frames(data, picked), frames[picked])
    with pytest.raises(VideoError, match="ends before frame 9"):
        decode_frames(data, [3, 9])


@pytest.mark.parametrize("height, width", [(64, 96), (32, 32), (96, 160)])
def test_frames_resized_as_decoded_equal_the_batch_resize(height, width):
    """The encoder holds each frame at its planned size from the moment it is decoded:
    the same bytes as resizing the decoded batch, repeats included."""
    data = encode_video(synthetic_frames(9, 48, 80, seed=6), "mp4")
    picked = [0, 3, 3, 8]
    full = torch.from_numpy(decode_frames(data, picked)).permute(0, 3, 1, 2).contiguous()
    expected = resize_frames(full, height, width).permute(0, 2, 3, 1)
    held = decode_frames(data, picked, resize=frame_resizer(height, width))
    assert held.shape == (4, height, width, 3) and torch.equal(torch.from_numpy(held), expected)


# (video kind, transformers' call kwargs) per checkpoint preset
CASES = {
    "tiny": [  # Qwen3-VL
        ("mp4", {}),  # 2 fps of a 5 fps clip, 48x64 -> 64x64 (bicubic up)
        ("webm", {"size": {"shortest_edge": 4096, "longest_edge": 5 * 32 * 32}}),  # resized down
        ("mkv", {"num_frames": 5, "fps": None}),  # odd count: the last frame fills the group
    ],
    "qwen2.5-vl-tiny": [
        ("mp4", {}),  # every frame, 48x64 -> 56x56
        ("mkv", {"do_sample_frames": True, "fps": 2}),
    ],
}


def _options(kwargs: dict) -> VideoOptions:
    options = {k: v for k, v in kwargs.items() if v is not None and k != "size"}
    if size := kwargs.get("size"):
        options.update(min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
    return VideoOptions.from_kwargs(options)


@pytest.mark.skipif(not reference_available(), reason="scripts/env.sh dev installs the reference")
@pytest.mark.parametrize("preset", list(CASES))
def test_preprocessing_equals_transformers(tmp_path, preset):
    write_processor_configs(tmp_path, PRESETS[preset])
    geometry = VideoGeometry.from_pretrained(tmp_path)
    videos = [(encode_video(synthetic_frames(11, seed=i), kind, fps=5), kwargs)
              for i, (kind, kwargs) in enumerate(CASES[preset])]
    refs = hf_video_outputs(str(tmp_path), [(decode_frames(data, range(11)), plan_video(data, geometry)[0], [kwargs])
                                            for data, kwargs in videos], tmp_path / "ref")
    for (data, kwargs), [ref] in zip(videos, refs):
        meta, plan = plan_video(data, geometry, _options(kwargs))
        pixels, grid = VideoPreprocessor(geometry)(decode_frames(data, plan.frame_indices), plan)
        assert list(plan.frame_indices) == ref["frames_indices"], kwargs
        assert list(grid) == ref["video_grid_thw"], kwargs
        assert (plan.resized_height, plan.resized_width) != (meta.height, meta.width)  # a real resize ran
        assert pixels.dtype == torch.float32
        assert torch.equal(pixels, ref["pixel_values_videos"]), kwargs
