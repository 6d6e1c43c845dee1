"""A video's plan (sampled frames, resized size, placeholder tokens) from its
container header alone, against transformers' own video processors given
every decoded frame and the same metadata (tests/testkit/video_reference.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from epd.transport.media.video_geometry import VideoGeometry, VideoOptions, _torch_arange_int
from epd.encoders.video_io import decode_frames
from epd.inputs.video_header import VideoError, plan_video
from epd.families.qwen_vl.presets import PRESETS, write_processor_configs
from testkit.video_reference import hf_video_outputs, reference_available
from testkit.videos import claims_hours, claims_size, encode_video, gif_frames, synthetic_frames

pytest.importorskip("av")
needs_reference = pytest.mark.skipif(not reference_available(), reason="scripts/env.sh dev installs the reference")

# per-request kwargs (vLLM's mm_processor_kwargs), as transformers is called with them
CALLS = {
    "qwen3": [{}, {"fps": 1}, {"fps": 4}, {"num_frames": 5, "fps": None}, {"do_sample_frames": False},
              {"max_frames": 2}, {"size": {"shortest_edge": 4096, "longest_edge": 4 * 64 * 64}}],
    # the releases' config with the per-frame pixel cap on (transformers' future default)
    "qwen3-capped": [{}, {"fps": 4}, {"size": {"shortest_edge": 64, "longest_edge": 40 * 64 * 64}}],
    "qwen2.5-capped": [{"do_sample_frames": True, "fps": 4}],
    "qwen2.5": [{}, {"do_sample_frames": True, "fps": 2}, {"do_sample_frames": True, "num_frames": 6},
                {"do_sample_frames": True, "fps": 1, "min_frames": 2, "max_frames": 4},
                {"max_pixels": 28 * 28 * 2}, {"min_pixels": 112 * 112}],
}
PRESET = {"qwen3": "tiny", "qwen2.5": "qwen2.5-vl-tiny", "qwen3-capped": "tiny", "qwen2.5-capped": "qwen2.5-vl-tiny"}


def _options(kwargs: dict) -> VideoOptions:
    """transformers' call kwargs -> ours (size -> min/max_pixels; fps=None beside num_frames is implied)."""
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if size := kwargs.pop("size", None):
        kwargs.update(min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
    return VideoOptions.from_kwargs(kwargs)


def _configs(tmp_path, family: str) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    write_processor_configs(tmp_path, PRESETS[PRESET[family]])
    if family.endswith("-capped"):
        for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
            if (path := tmp_path / name).exists():
                path.write_text(json.dumps({**json.loads(path.read_text()), "cap_pixels_per_frame": True,
                                            "max_video_tokens": 3}))
                break
    return str(tmp_path)


@needs_reference
@pytest.mark.parametrize("family", list(CALLS))
def test_plan_from_header_matches_transformers(tmp_path, family):
    model_dir = _configs(tmp_path, family)
    geometry = VideoGeometry.from_pretrained(model_dir)
    data = encode_video(synthetic_frames(11, height=96, width=160), "mkv", fps=5)
    frames = decode_frames(data, range(11))
    meta, _ = plan_video(data, geometry)
    [refs] = hf_video_outputs(model_dir, [(frames, meta, CALLS[family])], tmp_path / "ref")
    for kwargs, ref in zip(CALLS[family], refs):
        assert "error" not in ref, (kwargs, ref)
        _, plan = plan_video(data, geometry, _options(kwargs))
        assert list(plan.frame_indices) == ref["frames_indices"], kwargs
        assert list(plan.grid_thw) == ref["video_grid_thw"], kwargs
        t, h, w = ref["video_grid_thw"]
        assert plan.num_tokens == t * h * w // ref["merge_size"] ** 2, kwargs
        assert plan.tokens_per_group * t == plan.num_tokens
        if family.startswith("qwen3"):
            assert list(plan.group_timestamps_s) == ref["timestamps"], kwargs
        else:
            assert plan.second_per_grid_t == geometry.temporal_patch_size / ref["sampled_fps"], kwargs


@needs_reference
def test_refusals_match_transformers(tmp_path):
    """A one-frame video: Qwen3-VL needs two frames per temporal group and refuses it."""
    model_dir = _configs(tmp_path, "qwen3")
    data = encode_video(synthetic_frames(1), "mp4")
    geometry = VideoGeometry.from_pretrained(model_dir)
    with pytest.raises(VideoError, match="at least 2"):
        plan_video(data, geometry)
    meta = plan_video(data, VideoGeometry.from_pretrained(_configs(tmp_path / "q25", "qwen2.5")))[0]
    [[ref]] = hf_video_outputs(model_dir, [(decode_frames(data, [0]), meta, [{}])], tmp_path / "ref")
    assert "must be larger than temporal_factor" in ref["error"]


def test_made_checkpoints_carry_the_releases_video_config(tmp_path):
    """Qwen3-VL releases ship video_preprocessor_config.json; Qwen2.5-VL's do not (video reads the image one)."""
    qwen3 = VideoGeometry.from_pretrained(_configs(tmp_path / "q3", "qwen3"))
    assert (tmp_path / "q3" / "video_preprocessor_config.json").exists()
    assert (qwen3.family, qwen3.min_pixels, qwen3.max_pixels, qwen3.patch_size) == ("qwen3_vl", 4096, 25165824, 16)
    assert (qwen3.fps, qwen3.do_sample_frames, qwen3.image_mean) == (2, True, (0.5, 0.5, 0.5))
    qwen25 = VideoGeometry.from_pretrained(_configs(tmp_path / "q25", "qwen2.5"))
    assert not (tmp_path / "q25" / "video_preprocessor_config.json").exists()
    preset = PRESETS["qwen2.5-vl-tiny"]
    assert (qwen25.family, qwen25.min_pixels, qwen25.max_pixels) == ("qwen2_vl", preset.min_pixels, preset.max_pixels)
    assert (qwen25.patch_size, qwen25.do_sample_frames, qwen25.fps) == (14, False, None)


@pytest.mark.parametrize("kind", ["mp4", "mkv", "webm"])
def test_header_reads_count_rate_and_size(kind):
    data = encode_video(synthetic_frames(7, height=40, width=72), kind, fps=4)
    geometry = VideoGeometry.from_config({"video_processor_type": "Qwen3VLVideoProcessor"})
    meta, plan = plan_video(data, geometry)
    assert (meta.num_frames, meta.fps, meta.width, meta.height) == (7, 4.0, 72, 40)
    assert meta.duration_s == 7 / 4
    assert plan.frame_indices == (0, 2, 4, 6)  # 1.75 s at 2 fps -> 3, raised to min_frames 4


def test_bad_videos_are_refused_with_a_reason(tmp_path):
    geometry = VideoGeometry.from_config({"video_processor_type": "Qwen3VLVideoProcessor"})
    with pytest.raises(VideoError, match="cannot open video"):
        plan_video(b"not a video at all" * 10, geometry)
    data = encode_video(synthetic_frames(9), "mp4")
    with pytest.raises(VideoError, match="9 frames; the limit is 8"):
        plan_video(data, geometry, max_frames=8)
    with pytest.raises(VideoError, match="cannot open video"):
        plan_video(data[: len(data) // 3], geometry)
    with pytest.raises(VideoError, match="no video stream"):
        plan_video(_audio_only_wav(), geometry)


def test_a_container_without_a_count_is_counted_only_up_to_the_limit():
    """Matroska keeps no frame count: the header read demuxes packets, and stops past
    max_frames instead of reading a file of millions of tiny frames to the end."""
    geometry = VideoGeometry.from_config({"video_processor_type": "Qwen3VLVideoProcessor"})
    data = encode_video(synthetic_frames(12), "mkv")
    with pytest.raises(VideoError, match=r"more than 10 frames; the limit is 10 \(--max-video-frames\)"):
        plan_video(data, geometry, max_frames=10)
    assert plan_video(data, geometry, max_frames=12)[0].num_frames == 12


def test_headers_that_claim_too_much_are_refused_from_the_header():
    """Ten hours in a 5 kB mp4, a 10000x10000 stream, a GIF of 5,000 frames: each refused
    by the API's limits before any frame is decoded."""
    geometry = VideoGeometry.from_config({"video_processor_type": "Qwen3VLVideoProcessor"})
    with pytest.raises(VideoError, match="1080000 frames; the limit is 4096"):
        plan_video(claims_hours(10, fps=30), geometry, max_frames=4096)
    with pytest.raises(VideoError, match="frames of 10000x10000 exceed the limit of 64000000 pixels"):
        plan_video(claims_size(10000, 10000), geometry, max_frames=4096, max_frame_pixels=64_000_000)
    with pytest.raises(VideoError, match="5000 frames; the limit is 4096"):
        plan_video(gif_frames(5000), geometry, max_frames=4096)


def _audio_only_wav() -> bytes:
    import io

    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="wav") as container:
        stream = container.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return buf.getvalue()


def test_request_kwargs_are_checked():
    assert VideoOptions.from_kwargs({"fps": 1.5, "max_pixels": 9000}).fps == 1.5
    for bad in ({"fps": 0}, {"num_frames": -1}, {"do_sample_frames": 1}, {"fps": 2, "num_frames": 4},
                {"temporal_patch_size": 3}, {"max_pixels": True}):
        with pytest.raises(ValueError):
            VideoOptions.from_kwargs(bad)


@pytest.mark.parametrize("total", [1, 2, 3, 7, 10, 29, 30, 97, 240, 1001])
def test_qwen2_frame_steps_are_torch_arange(total):
    """Qwen2-VL samples with torch.arange(0, total, total / n).int(): float32 steps, truncated."""
    for num in range(1, total + 1):
        expected = torch.arange(0, total, total / num).int().tolist()
        assert _torch_arange_int(total, total / num) == expected, (total, num)
    assert np.array_equal(_torch_arange_int(10, 10 / 4), [0, 2, 5, 7])
