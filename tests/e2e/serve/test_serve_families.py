"""`epd serve` of Qwen3-VL-MoE and Qwen2.5-VL, each in e-p-d and one other mode: one text and one
two-image chat give transformers' greedy text (the engine, the encoder
worker, the KV transfer and the embedding cache are the same for every
family), and a video chat the offline `LLM.chat`'s (aggregated: the video
encoded in-process, docs/architecture.md "Video: serving")."""
from __future__ import annotations

import pytest
from testkit.family_checkpoints import family_checkpoint
from testkit.hf_reference import hf_generate_text
from testkit.media import CHATS
from testkit.media import data_url
from testkit.server import chat_text, start_server
from testkit.videos import encode_video, synthetic_frames

MAX_TOKENS = 10
CHAT_NAMES = ["text_only", "two_images"]


def video_chat() -> list[dict]:
    clip = encode_video(synthetic_frames(9, 48, 64, seed=8), "mp4", fps=4)
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": data_url(clip, "video/mp4")}},
                                         {"type": "text", "text": "What happens?"}]}]


def offline_text(model_dir: str, messages: list[dict]) -> str:
    from epd.llm import LLM
    from epd.transport.wire.sampling import SamplingParams

    [out] = LLM(model_dir).chat([messages], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return out.outputs[0].text


@pytest.mark.slow
# Each family in e-p-d (its positions and embeddings handed across three processes) and in one
# of the others (aggregated: the video encoded in-process; e-pd: embeddings from an encoder
# worker into a prefill+decode worker): four servers instead of the six of the full product.
@pytest.mark.parametrize(("family", "mode"), [("qwen3_vl_moe", "e-p-d"), ("qwen3_vl_moe", "aggregated"),
                                              ("qwen2_5_vl", "e-p-d"), ("qwen2_5_vl", "e-pd")])
def test_served_text_equals_transformers(family, mode, tmp_path):
    model_dir = family_checkpoint(family)
    expected = {n: hf_generate_text(model_dir, CHATS[n][0], CHATS[n][1], max_new_tokens=MAX_TOKENS)
                for n in CHAT_NAMES}
    video = video_chat()
    expected_video = offline_text(model_dir, video)
    srv = start_server(model_dir, tmp_path, mode)
    try:
        for name in CHAT_NAMES:
            assert chat_text(srv, CHATS[name][0], MAX_TOKENS) == expected[name], name
            assert chat_text(srv, CHATS[name][0], MAX_TOKENS, stream=True) == expected[name], name
        assert chat_text(srv, video, MAX_TOKENS) == expected_video
    finally:
        assert srv.stop() == 0, srv.log()
    assert not srv.group_alive(), "a server process survived Ctrl-C"
