"""`epd serve` of InternVL (dense and MoE) in e-p-d, e-pd and aggregated: a text and a
two-image chat, plain and streamed, give transformers' greedy text (the tiles'
embeddings through the encoder worker and the cache, the 1-D positions and the
KV across three processes)."""
from __future__ import annotations

import pytest
from testkit.internvl_reference import hf_generate_text
from testkit.media import CHATS
from testkit.server import chat_text, start_server

from epd.tools.make_model import make_model

MAX_TOKENS = 10
CHAT_NAMES = ["text_only", "two_images", "multi_turn"]


@pytest.mark.slow
@pytest.mark.parametrize(("preset", "mode"), [("internvl-tiny", "e-p-d"), ("internvl-tiny", "aggregated"),
                                              ("internvl-moe-tiny", "e-p-d"), ("internvl-moe-tiny", "e-pd")])
def test_served_text_equals_transformers(preset, mode, tmp_path):
    model_dir = str(make_model(tmp_path / "ckpt", preset, seed=2))
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
