"""A cache fault is the server's, never the request's: an embedding too large
for `--mm-cache-gb` travels inline to the prefill worker and the answer is
transformers' own."""
from __future__ import annotations

import pytest
from hf_reference import hf_generate_text
from media import CHATS
from server import chat_text, start_server

MAX_TOKENS = 10


@pytest.mark.slow
def test_embeddings_too_large_for_the_cache_travel_inline(tiny_model, tmp_path):
    messages, images = CHATS["two_images"]
    expected = hf_generate_text(tiny_model, messages, images, max_new_tokens=MAX_TOKENS)
    # ~1 KB: no embedding of the tiny model fits
    server = start_server(tiny_model, tmp_path, "e-p-d", "--mm-cache-gb", "0.000001")
    try:
        for stream in (False, True):
            assert chat_text(server, messages, MAX_TOKENS, stream=stream) == expected
        assert server.settled_sum("epd:encoder_images_total", role="encoder") == 4  # nothing came from the cache
    finally:
        assert server.stop() == 0, server.log()
