"""encoders/video_encoder.py: a video's entries keyed as its spans name them
(one per temporal group for Qwen3-VL, with deepstack; one for Qwen2.5-VL),
and the same rows whether the tower takes the groups in one pass or a few at
a time (attention stays within a group). Equality with transformers' model is
tests/unit/engine/test_video_vs_transformers.py."""
from __future__ import annotations

import pytest
import torch

from epd.encoders.image_encoder import ImageEncoder
from epd.encoders.video_encoder import VideoEncoder
from epd.encoders.video_io import VideoError
from epd.transport.media.video_keys import entry_hashes, video_mm_hash
from epd.transport.media.video_geometry import VideoOptions, load_video_config
from epd.inputs.video_header import plan_video
from epd.tools.make_model import make_model
from testkit.videos import encode_video, synthetic_frames

pytest.importorskip("av")


def _encoders(model_dir: str, **kwargs) -> VideoEncoder:
    from transformers import AutoConfig

    images = ImageEncoder(model_dir, AutoConfig.from_pretrained(model_dir), torch.float32)
    return VideoEncoder(model_dir, images.vision, **kwargs)


@pytest.mark.parametrize("preset", ["tiny", "qwen2.5-vl-tiny"])
def test_entries_by_group_and_passes_give_the_same_rows(preset, tiny_model, tmp_path):
    model_dir = tiny_model if preset == "tiny" else str(make_model(tmp_path / "m", preset=preset, seed=1))
    video = _encoders(model_dir)
    data = encode_video(synthetic_frames(11, 64, 96), "mp4", fps=5)
    _, plan = plan_video(data, video.geometry)
    key = video_mm_hash(data, "fp", load_video_config(model_dir), plan)
    timed = []
    entries = video.encode(data, plan, key, on_video=lambda *a: timed.append(a))
    t, h, w = plan.grid_thw
    assert [k for k, _ in entries] == entry_hashes(key, plan)
    assert len(timed) == 1 and timed[0][0] == len(plan.frame_indices)
    if preset == "tiny":  # Qwen3-VL: a (1, h, w) entry per group, deepstack beside
        assert t > 1 and len(entries) == t
        assert all(e.meta["grid_thw"] == (1, h, w) and e.embeddings.shape[0] == h * w // 4 for _, e in entries)
        assert all(len(e.extras) == 2 and e.extras["deepstack.0"].shape == e.embeddings.shape for _, e in entries)
    else:
        [(_, entry)] = entries
        assert entry.meta["grid_thw"] == (t, h, w) and entry.embeddings.shape[0] == t * h * w // 4 and not entry.extras
    one_group_a_pass = _encoders(model_dir, max_batch_patches=h * w).encode(data, plan, key)
    for (_, a), (_, b) in zip(entries, one_group_a_pass):
        torch.testing.assert_close(a.embeddings, b.embeddings, atol=1e-6, rtol=0)
        for da, db in zip(a.extras.values(), b.extras.values()):
            torch.testing.assert_close(da, db, atol=1e-6, rtol=0)


def test_video_key_covers_the_plan_and_bytes(tiny_model):
    config = load_video_config(tiny_model)
    data = encode_video(synthetic_frames(11), "mp4", fps=5)
    video = _encoders(tiny_model)
    _, plan = plan_video(data, video.geometry)
    _, other = plan_video(data, video.geometry, VideoOptions(num_frames=6))
    keys = {video_mm_hash(data, "fp", config, plan), video_mm_hash(data, "fp", config, other),
            video_mm_hash(data + b"\0", "fp", config, plan), video_mm_hash(data, "fp2", config, plan)}
    assert len(keys) == 4
    with pytest.raises(VideoError):
        video.encode(data[: len(data) // 3], plan, "0" * 64)


@pytest.mark.parametrize("preset", ["tiny", "qwen2.5-vl-tiny"])
def test_chunks_encode_to_the_rows_of_the_whole_video(preset, tiny_model, tmp_path):
    """--video-chunk-frames (transport/media/video_chunks.py): each chunk encoded on its own gives
    the rows its groups have in the whole video; Qwen3-VL's under the same group keys,
    Qwen2.5-VL's one entry per chunk under its range's key."""
    from epd.transport.media.video_chunks import split_plan
    from epd.transport.media.video_keys import chunk_mm_hash

    model_dir = tiny_model if preset == "tiny" else str(make_model(tmp_path / "m", preset=preset, seed=1))
    video = _encoders(model_dir)
    data = encode_video(synthetic_frames(13, 64, 96), "mp4", fps=5)
    _, plan = plan_video(data, video.geometry, VideoOptions(fps=5) if preset == "tiny" else VideoOptions())
    key = video_mm_hash(data, "fp", load_video_config(model_dir), plan)
    whole = video.encode(data, plan, key)
    chunks = split_plan(plan, video.geometry.temporal_patch_size, chunk_frames=4)  # 2 groups a chunk
    t, h, w = plan.grid_thw
    assert len(chunks) == -(-t // 2) >= 3 and len(plan.frame_indices) % 2  # the last chunk fills its last group
    pieces = [video.encode(data, chunk, key) for chunk in chunks]
    if preset == "tiny":
        assert [k for piece in pieces for k, _ in piece] == [k for k, _ in whole]
        rows = [e for piece in pieces for _, e in piece]
        for a, (_, b) in zip(rows, whole):
            torch.testing.assert_close(a.embeddings, b.embeddings, atol=1e-6, rtol=0)
            for da, db in zip(a.extras.values(), b.extras.values()):
                torch.testing.assert_close(da, db, atol=1e-6, rtol=0)
        return
    assert [k for [(k, _)] in pieces] == [chunk_mm_hash(key, c.first_group, c.first_group + c.grid_thw[0])
                                          for c in chunks]
    assert [e.meta["grid_thw"] for [(_, e)] in pieces] == [c.grid_thw for c in chunks]
    [(_, entry)] = whole
    torch.testing.assert_close(torch.cat([e.embeddings for [(_, e)] in pieces]), entry.embeddings, atol=1e-6, rtol=0)
