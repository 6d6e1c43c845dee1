"""`epd serve` of Qwen3-VL-MoE and Qwen2.5-VL in every mode: one text and one
two-image chat give transformers' greedy text (the engine, the encoder
worker, the KV transfer and the embedding cache are the same for every
family)."""
from __future__ import annotations

import pytest
from testkit.family_checkpoints import family_checkpoint
from testkit.hf_reference import hf_generate_text
from testkit.media import CHATS
from testkit.server import chat_text, start_server

MAX_TOKENS = 10
CHAT_NAMES = ["text_only", "two_images"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["aggregated", "e-pd", "e-p-d"])
@pytest.mark.parametrize("family", ["qwen3_vl_moe", "qwen2_5_vl"])
def test_served_text_equals_transformers(family, mode, tmp_path):
    model_dir = family_checkpoint(family)
    expected = {n: hf_generate_text(model_dir, CHATS[n][0], CHATS[n][1], max_new_tokens=MAX_TOKENS)
                for n in CHAT_NAMES}
    srv = start_server(model_dir, tmp_path, mode)
    try:
        for name in CHAT_NAMES:
            assert chat_text(srv, CHATS[name][0], MAX_TOKENS) == expected[name], name
            assert chat_text(srv, CHATS[name][0], MAX_TOKENS, stream=True) == expected[name], name
    finally:
        assert srv.stop() == 0, srv.log()
    assert not srv.group_alive(), "a server process survived Ctrl-C"
