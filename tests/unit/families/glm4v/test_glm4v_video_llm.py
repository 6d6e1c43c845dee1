"""A GLM-4.1V chat with a video, and with a video and an image, through the
offline `LLM` (the header plan, PyAV decode, the tower a temporal group at a
time, each group an image-token span told from the images' by the
placeholders' order, the 3-D positions, prefill in chunks across the groups)
gives transformers' prompt ids, greedy tokens and top-5 logprobs (float32;
testkit/family_video_reference.py)."""
from __future__ import annotations

import pytest
from testkit.family_checkpoints import family_checkpoint
from testkit.family_video_reference import TOP, assert_same_greedy, glm4v_greedy
from testkit.media import IMG_A, image_part
from testkit.video_reference import VideoClips, reference_available
from testkit.videos import encode_video, synthetic_frames

from epd.transport.wire.sampling import SamplingParams

pytest.importorskip("av")
pytestmark = pytest.mark.skipif(not reference_available(), reason="scripts/env.sh dev installs the reference")

NUM_TOKENS = 6


def test_video_chats_equal_transformers(tmp_path):
    from epd import LLM
    from epd.encoders.video_io import decode_frames, read_video_meta

    model_dir = family_checkpoint("glm4v")
    data = encode_video(synthetic_frames(12, 60, 90, seed=4), "mp4", fps=5)  # 2.4 s at 2 fps: 4 frames, 2 groups
    (tmp_path / "clip.mp4").write_bytes(data)
    video = {"type": "video_url", "video_url": {"url": f"file://{tmp_path / 'clip.mp4'}"}}
    chats = {"video": ([video], []), "image_and_video": ([image_part(IMG_A), video], [IMG_A])}
    meta = read_video_meta(data)
    frames = decode_frames(data, range(meta.num_frames))

    llm = LLM(model_dir, dtype="float32", device="cpu", max_num_batched_tokens=16)  # chunks cut the groups
    messages = {name: [{"role": "user", "content": [*parts, {"type": "text", "text": "What happens?"}]}]
                for name, (parts, _) in chats.items()}
    outs = llm.chat(list(messages.values()),
                    SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=TOP))
    expected = glm4v_greedy(model_dir, [(messages[name], images, VideoClips([(frames, meta)], {}, tmp_path / name))
                                        for name, (_, images) in chats.items()], NUM_TOKENS)
    for name, out, greedy in zip(chats, outs, expected):
        assert_same_greedy(out, greedy, name)
