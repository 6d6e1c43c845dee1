"""`epd serve` of Qwen3.5 (hybrid Gated DeltaNet: per-request state in the engine's state cache)
in the modes where one engine prefills and decodes: a text and a two-image chat give
transformers' greedy text, streamed and not (aggregated: the images encoded in-process; e-pd:
embeddings from an encoder worker into a prefill+decode worker); /metrics shows the engine
worker's state cache usage."""
from __future__ import annotations

import httpx
import pytest
from testkit.hf_reference import hf_generate_text
from testkit.media import CHATS
from testkit.server import chat_text, start_server

MAX_TOKENS = 10
CHAT_NAMES = ["text_only", "two_images"]


@pytest.fixture(scope="module")
def qwen3_5_checkpoint(tmp_path_factory) -> str:
    from epd.tools.make_model import make_model

    return str(make_model(tmp_path_factory.mktemp("ckpt") / "qwen3_5-tiny", "qwen3_5-tiny", seed=0))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["aggregated", "e-pd"])
def test_served_text_equals_transformers(qwen3_5_checkpoint, mode, tmp_path):
    expected = {n: hf_generate_text(qwen3_5_checkpoint, CHATS[n][0], CHATS[n][1], max_new_tokens=MAX_TOKENS)
                for n in CHAT_NAMES}
    srv = start_server(qwen3_5_checkpoint, tmp_path, mode)
    try:
        for name in CHAT_NAMES:
            assert chat_text(srv, CHATS[name][0], MAX_TOKENS) == expected[name], name
            assert chat_text(srv, CHATS[name][0], MAX_TOKENS, stream=True) == expected[name], name
        usage = [line for line in httpx.get(srv.base_url + "/metrics", timeout=30).text.splitlines()
                 if line.startswith("epd:state_cache_usage_perc{")]
        assert len(usage) == 1 and 0.0 <= float(usage[0].split()[-1]) <= 1.0, usage  # the engine worker's slots
    finally:
        assert srv.stop() == 0, srv.log()
    assert not srv.group_alive(), "a server process survived Ctrl-C"
