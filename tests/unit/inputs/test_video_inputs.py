"""The Preparer's video step (epd/inputs/video_inputs.py) on the tiny checkpoint's
files: whose settings apply (checkpoint, --mm-processor-kwargs, the request), the
limits read from the header, and keys that follow the plan."""
from __future__ import annotations

import shutil

import pytest

from epd.transport.media.video_geometry import VideoOptions
from epd.inputs.media import MediaConfig
from epd.inputs.model_files import ModelFiles
from epd.requests import RequestError
from epd.inputs.video_inputs import VideoInputs
from testkit.videos import encode_video, synthetic_frames

pytest.importorskip("av")
CLIP = encode_video(synthetic_frames(11, 48, 64), "mp4", fps=5)


@pytest.fixture(scope="module")
def files(tiny_model):
    return ModelFiles.open(tiny_model)


def inputs(files, server_kwargs=None, **media) -> VideoInputs:
    return VideoInputs(files, MediaConfig(**media), server_kwargs or {}, "fp")


def refused(videos: VideoInputs, data: bytes = CLIP, kwargs=None) -> RequestError:
    with pytest.raises(RequestError) as info:
        videos.plan([data], kwargs)
    assert info.value.status == 400 and info.value.param in ("messages", "mm_processor_kwargs")
    return info.value


def test_the_request_overrides_the_server_which_overrides_the_checkpoint(files):
    videos = inputs(files, {"fps": 1, "max_frames": 6})
    assert videos.options(None) == VideoOptions(fps=1, max_frames=6)
    assert videos.options({"num_frames": 4}) == VideoOptions(num_frames=4, max_frames=6)  # its fps is dropped
    assert inputs(files, {"num_frames": 4}).options({"fps": 2}) == VideoOptions(fps=2)
    assert "fps and num_frames" in refused(videos, kwargs={"fps": 2, "num_frames": 4}).message


def test_keys_follow_the_plan(files):
    videos = inputs(files)
    [a], [b], [c] = videos.plan([CLIP], None), videos.plan([CLIP], None), videos.plan([CLIP], {"fps": 4})
    assert a.mm_hash == b.mm_hash != c.mm_hash  # sampled otherwise: another entry
    assert len(a.plan.frame_indices) < len(c.plan.frame_indices)
    assert len(a.entry_hashes) == a.plan.grid_thw[0] > 1  # Qwen3-VL: an entry per temporal group
    [piece] = a.pieces()  # no --video-chunk-frames: one EncodeRequest, under the video's key
    assert piece.key == a.mm_hash and piece.plan.frame_indices == a.plan.frame_indices
    assert piece.num_patches == piece.plan.num_patches == a.plan.grid_thw[0] * a.plan.grid_thw[1] * a.plan.grid_thw[2]


def test_a_longer_video_is_cut_into_chunks_of_whole_groups(files):
    """--video-chunk-frames 2: a chunk per temporal group (2 frames), each its own
    EncodeRequest: its frames, its patches (the router's cost), its entries' keys;
    together they are the video's, under the same keys (Qwen3-VL: one per group)."""
    [whole] = inputs(files).plan([CLIP], {"fps": 4})
    [cut] = inputs(files, video_chunk_frames=2).plan([CLIP], {"fps": 4})
    assert cut.mm_hash == whole.mm_hash and cut.entry_hashes == whole.entry_hashes
    pieces = cut.pieces()
    assert len(pieces) == whole.plan.grid_thw[0] > 2
    assert [i for p in pieces for i in p.plan.frame_indices] == list(whole.plan.frame_indices)
    assert sum(p.num_patches for p in pieces) == whole.pieces()[0].num_patches
    assert [cut.piece_entries(p) for p in pieces] == [[k] for k in whole.entry_hashes]
    assert [p.key for p in pieces] == whole.entry_hashes and len({p.key for p in pieces}) == len(pieces)
    assert [p.plan.first_group for p in pieces] == list(range(len(pieces)))
    [short] = inputs(files, video_chunk_frames=64).plan([CLIP], None)  # fits in one chunk: not cut
    assert short.chunks == () and short.pieces()[0].key == short.mm_hash
    with pytest.raises(ValueError, match="--video-chunk-frames"):
        MediaConfig(video_chunk_frames=-1)


def test_media_io_num_frames_takes_frames_before_the_processor(files):
    [planned] = inputs(files, video_num_frames=4).plan([CLIP], None)
    assert planned.plan.frame_indices == (0, 3, 6, 10)  # vLLM's loader: linspace(0, 10, 4), truncated


@pytest.mark.parametrize("media, message", [
    ({"max_video_frames": 10}, "the video has 11 frames; the limit is 10 (--max-video-frames)"),
    ({"max_image_pixels": 48 * 64 - 1}, "video frames of 64x48 exceed the limit of 3071 pixels"),
    ({"max_request_video_pixels": 11 * 48 * 64 - 1}, "(--max-request-video-pixels)"),
])
def test_limits_from_the_header(files, media, message):
    assert message in refused(inputs(files, **media)).message
    inputs(files, **{k: v + 1 for k, v in media.items()}).plan([CLIP], None)  # one more fits


def test_not_a_video_and_no_video_config(files, tiny_model, tmp_path):
    assert "video: cannot open video" in refused(inputs(files), b"not a video at all" * 20).message
    bare = tmp_path / "bare"
    shutil.copytree(tiny_model, bare)
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        (bare / name).unlink()
    message = refused(inputs(ModelFiles.open(bare))).message
    assert "no video_preprocessor_config.json (nor preprocessor_config.json)" in message


def test_the_video_rules_are_the_checkpoints_familys(tmp_path):
    """ModelFiles asks the family for its video rules: GLM-4.1V's plan, not Qwen's; a family that
    takes no video (Gemma 3) refuses a video by its name, a 400, before any header is read."""
    from testkit.family_checkpoints import family_checkpoint

    from epd.families.glm4v.video_geometry import Glm4vVideoGeometry
    from epd.tools.make_model import make_model

    glm = ModelFiles.open(family_checkpoint("glm4v"))
    assert isinstance(glm.video_geometry, Glm4vVideoGeometry)
    assert inputs(glm).plan([CLIP], None)[0].plan.group_timestamps_s == (0.0, 1.0)  # 2 fps of 2.2 s: 2 groups
    gemma = ModelFiles.open(make_model(tmp_path / "gemma3", "gemma3-tiny", seed=0))
    assert gemma.video_geometry is None and gemma.geometry is not None
    error = refused(inputs(gemma), b"not even read")
    assert error.message == "Gemma 3 takes no video input" and error.param == "messages"
