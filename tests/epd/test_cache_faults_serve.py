"""`epd serve` over a damaged embedding cache (issue 33, item 7): it starts,
answers image requests, and caches again, the damaged file set aside once."""
from __future__ import annotations

import torch
from media import describe, image_bytes
from mm_cache_damage import garble_tree_pages, set_aside
from server import chat_text, start_server

from epd.transport.mm_cache import MMCache, mm_hash
from epd.transport.mm_entry import MMEntry


def test_a_corrupt_cache_dir_does_not_block_start_up(tiny_model, tmp_path):
    cache = tmp_path / "cache"
    with MMCache(cache, 1 << 24, model_fingerprint="an earlier model") as c:
        for i in range(5):
            c.put(mm_hash(bytes([i]), "an earlier model", {}), MMEntry(torch.ones(4, 8), [], (1, 2, 2)))
    garble_tree_pages(cache)  # every start failed with MDB_CORRUPTED here
    messages = describe(image_bytes(80, 120, seed=5))
    server = start_server(tiny_model, tmp_path, "e-pd", "--mm-cache-dir", str(cache))
    try:
        first = chat_text(server, messages, max_tokens=8)
        assert chat_text(server, messages, max_tokens=8) == first
        assert server.metric_sum("epd:mm_cache_hits_total") == 1  # the API reads the fresh cache
        assert server.settled_sum("epd:encoder_images_total") == 1
        assert server.log().count("set aside") == 1
    finally:
        assert server.stop() == 0
    assert [name.split(".corrupt-")[0] for name in set_aside(cache)] == ["data.mdb", "lock.mdb"]
