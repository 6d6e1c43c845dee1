"""InternVL video as frames through the offline `LLM`: the header plan
(InternVLVideoProcessor's frames: every one, or sampled by fps or num_frames from
half a step in), each frame one tile with "Frame{i}:" and `<img>`..`</img>` around
it, the frames' entries told from an image's by the placeholders' order, gives
transformers' prompt ids, greedy tokens and top-5 logprobs (float32; its whole
InternVLProcessor and InternVLForConditionalGeneration,
testkit/family_video_reference.py); the plan's frames are the processor's."""
from __future__ import annotations

import pytest
from testkit.family_video_reference import TOP, assert_same_greedy, internvl_greedy
from testkit.media import IMG_A, image_part
from testkit.video_reference import VideoClips, reference_available
from testkit.videos import encode_video, synthetic_frames

from epd.tools.make_model import make_model
from epd.transport.wire.sampling import SamplingParams

pytest.importorskip("av")
pytestmark = pytest.mark.skipif(not reference_available(), reason="scripts/env.sh dev installs the reference")

NUM_TOKENS = 6
# (the request's mm_processor_kwargs, transformers' processor kwargs, with an image)
CASES = {"every_frame": (None, {}, False),
         "fps_sampled": ({"do_sample_frames": True, "fps": 2}, {"do_sample_frames": True, "fps": 2}, False),
         "image_and_sampled_frames": ({"do_sample_frames": True, "num_frames": 3},
                                      {"do_sample_frames": True, "num_frames": 3}, True)}


def test_video_chats_equal_transformers(tmp_path):
    from epd import LLM
    from epd.encoders.video_io import decode_frames, read_video_meta

    model_dir = str(make_model(tmp_path / "ckpt", "internvl-tiny", seed=5))
    data = encode_video(synthetic_frames(7, 48, 80, seed=6), "mp4", fps=5)
    (tmp_path / "clip.mp4").write_bytes(data)
    video = {"type": "video_url", "video_url": {"url": f"file://{tmp_path / 'clip.mp4'}"}}
    meta = read_video_meta(data)
    frames = decode_frames(data, range(meta.num_frames))

    chats = {name: [{"role": "user", "content": [*([image_part(IMG_A)] if with_image else []), video,
                                                 {"type": "text", "text": "What happens?"}]}]
             for name, (_, _, with_image) in CASES.items()}
    expected = internvl_greedy(model_dir, [(chats[name], [IMG_A] if with_image else [],
                                            VideoClips([(frames, meta)], theirs, tmp_path / name))
                                           for name, (_, theirs, with_image) in CASES.items()], NUM_TOKENS)
    llm = LLM(model_dir, dtype="float32", device="cpu", max_num_batched_tokens=24)  # chunks cut the frames
    for (name, (ours, _, with_image)), greedy in zip(CASES.items(), expected):
        [out] = llm.chat(chats[name], SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True,
                                                     logprobs=TOP), mm_processor_kwargs=ours)
        num_frames = {"every_frame": meta.num_frames, "fps_sampled": 2, "image_and_sampled_frames": 3}[name]
        assert out.prompt_token_ids.count(llm.tokenizer.convert_tokens_to_ids("<img>")) == num_frames + with_image
        assert_same_greedy(out, greedy, name)
