"""A video's plan on the wire (transport/media/video_plan_fields.py: a VideoPlan inside an
EncodeRequest): every field crosses, and a plan an encoder could not decode
or lay out as counted is a WireError at decode, naming the field."""
from __future__ import annotations

import msgpack
import pytest

from epd.transport.wire.messages import EncodeRequest, WireError, decode_message
from epd.transport.media.video_geometry import VideoPlan

HASH = "ab" * 32
QWEN3 = VideoPlan((0, 3, 6, 9, 10), 64, 96, (3, 4, 6), 18, 6, (0.3, 1.5, 2.0))  # last frame repeats into group 3
QWEN25 = VideoPlan((0, 1, 2, 3), 56, 84, (2, 4, 6), 12, 6, (), 0.4)
CHUNK = VideoPlan((4, 5, 6), 56, 84, (2, 4, 6), 12, 6, (), 0.4, first_group=2, total_groups=4)  # --video-chunk-frames


@pytest.mark.parametrize("video", [QWEN3, QWEN25, CHUNK, None], ids=["qwen3", "qwen2.5", "chunk", "image"])
def test_encode_request_carries_the_plan(video):
    msg = EncodeRequest("r-1", HASH, b"\x00\x01video", reply_to="ipc:///tmp/epd-x/prefill-0.sock", video=video)
    out = decode_message([bytes(f) for f in msg.to_wire()])
    assert isinstance(out, EncodeRequest)
    assert (out.image, out.mm_hash, out.video) == (msg.image, HASH, video)
    if video is not None:
        assert out.video.num_patches == video.grid_thw[0] * video.grid_thw[1] * video.grid_thw[2]


def _with_video(**changes) -> list[bytes]:
    frames = [bytes(f) for f in EncodeRequest("r", HASH, b"x", reply_to="tcp://h:1", video=QWEN3).to_wire()]
    header = msgpack.unpackb(frames[0], raw=False)
    header["video"] = {**header["video"], **changes}
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


@pytest.mark.parametrize("changes, match", [
    ({"frame_indices": []}, r"frame_indices: 1 to"),
    ({"frame_indices": [3, 2, 6, 9, 10]}, r"non-decreasing"),
    ({"frame_indices": [-1, 3, 6, 9, 10]}, r"non-decreasing frame numbers >= 0"),
    ({"frame_indices": [0, 1.5]}, r"frame_indices: expected list\[int\]"),
    ({"grid_thw": [9, 4, 6]}, r"is not a video's"),  # more temporal groups than frames
    ({"grid_thw": [3, 4, 5]}, r"does not tile"),
    ({"resized_height": 0}, r"is not a video's"),
    ({"num_tokens": 17}, r"17 tokens are not 3 groups of 6"),
    ({"group_timestamps_s": [0.3, 1.5]}, r"one finite time >= 0 per temporal group"),
    ({"second_per_grid_t": float("nan")}, r"second_per_grid_t: a finite number"),
    ({"fps": 2.0}, r"unknown fields \['fps'\]"),
    ({"first_group": 1}, r"missing field 'total_groups'"),  # a chunk names both
    ({"first_group": 2, "total_groups": 4}, r"groups 2..5 are not a chunk of 4 groups"),
    ({"first_group": 0, "total_groups": 3}, r"groups 0..3 are not a chunk of 3 groups"),  # the whole: no chunk
    ({"first_group": -1, "total_groups": 4}, r"are not a chunk"),
])
def test_a_plan_the_encoder_cannot_follow_is_refused(changes, match):
    with pytest.raises(WireError, match=match):
        decode_message(_with_video(**changes))


def test_the_wire_fields_are_the_plans_in_a_fixed_order():
    """The header the encoders read: the same fields, in the same order, as every release wrote them
    (a chunk's first_group and total_groups only when it is one)."""
    from epd.transport.media.video_plan_fields import video_to_map

    assert list(video_to_map(CHUNK).items()) == [
        ("frame_indices", [4, 5, 6]), ("resized_height", 56), ("resized_width", 84), ("grid_thw", [2, 4, 6]),
        ("num_tokens", 12), ("tokens_per_group", 6), ("group_timestamps_s", []), ("second_per_grid_t", 0.4),
        ("first_group", 2), ("total_groups", 4)]
    assert "first_group" not in video_to_map(QWEN3) and video_to_map(QWEN3)["group_timestamps_s"] == [0.3, 1.5, 2.0]
