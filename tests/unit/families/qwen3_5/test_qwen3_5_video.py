"""A Qwen3.5 video chat (with an image) through the offline `LLM` equals transformers in float32:
its own processor (Qwen3VLProcessor, in a child process with torchvision) on the same decoded
frames and Qwen3_5ForConditionalGeneration; the prompt's token ids, the greedy tokens and the
top-5 logprobs at each token (tests/unit/engine/test_video_vs_transformers.py does the same for
Qwen3-VL and Qwen2.5-VL). The video's prompt is prefilled over several chunks."""
from __future__ import annotations

import pytest
import torch
from testkit.hf_reference import hf_greedy_logprobs, hf_inputs
from testkit.media import IMG_A, image_part
from testkit.video_reference import VideoClips, reference_available
from testkit.videos import encode_video, synthetic_frames

from epd.transport.wire.sampling import SamplingParams

pytest.importorskip("av")
pytestmark = pytest.mark.skipif(not reference_available(), reason="scripts/env.sh dev installs the reference")

NUM_TOKENS, TOP = 5, 5


def _hf_greedy_logprobs(model, model_dir, messages, images, videos) -> tuple[list[int], list[int], list[list]]:
    """(prompt ids, greedy tokens, each step's top-5 (token, logprob)) by transformers, one full forward a token."""
    return hf_greedy_logprobs(model, hf_inputs(model_dir, messages, images, videos), NUM_TOKENS, TOP)


@pytest.mark.parametrize("qwen3_5_model", ["qwen3.5-tiny"], indirect=True)
def test_llm_chat_with_video_equals_transformers(qwen3_5_model, qwen3_5_reference, tmp_path):
    from epd import LLM
    from epd.encoders.video_io import decode_frames, read_video_meta

    data = encode_video(synthetic_frames(11, 64, 96, seed=7), "mp4", fps=5)
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": f"file://{path}"}},
                                             image_part(IMG_A), {"type": "text", "text": "What happens?"}]}]
    meta = read_video_meta(data)
    clips = VideoClips([(decode_frames(data, range(meta.num_frames)), meta)], {}, tmp_path / "ref")
    ref_prompt, ref_tokens, ref_logprobs = _hf_greedy_logprobs(qwen3_5_reference, qwen3_5_model, messages, [IMG_A],
                                                               clips)

    llm = LLM(qwen3_5_model, dtype="float32", max_num_batched_tokens=64)
    [out] = llm.chat(messages, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=TOP))
    assert out.prompt_token_ids == ref_prompt and len(ref_prompt) > 64
    assert out.outputs[0].token_ids == ref_tokens
    tops = [lp.top for lp in out.outputs[0].logprobs]
    assert [[t for t, _ in top] for top in tops] == [[t for t, _ in top] for top in ref_logprobs]
    torch.testing.assert_close([[v for _, v in top] for top in tops], [[v for _, v in top] for top in ref_logprobs],
                               atol=1e-4, rtol=0)
