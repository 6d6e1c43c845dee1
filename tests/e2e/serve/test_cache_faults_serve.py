"""`epd serve` over a damaged embedding cache (issue 33, item 7: it starts,
answers image requests and caches again, the damaged file set aside once) and
over a full one (item 9: it serves on, and caches again once space is back)."""
from __future__ import annotations

import os

import torch
from testkit.media import describe, image_bytes
from testkit.mm_cache_damage import garble_tree_pages, set_aside
from testkit.server import chat_text, start_server
from testkit.small_fs import fill_up, mounted_tmpfs

from epd.transport.embedding_cache.mm_cache import MMCache, mm_hash
from epd.transport.embedding_cache.mm_entry import MMEntry


def test_a_corrupt_cache_dir_does_not_block_start_up(tiny_model, tmp_path):
    cache = tmp_path / "cache"
    with MMCache(cache, 1 << 24, model_fingerprint="an earlier model") as c:
        for i in range(5):
            c.put(mm_hash(bytes([i]), "an earlier model", {}), MMEntry(torch.ones(4, 8), {}, {"grid_thw": (1, 2, 2)}))
    garble_tree_pages(cache)  # every start failed with MDB_CORRUPTED here
    messages = describe(image_bytes(80, 120, seed=5))
    server = start_server(tiny_model, tmp_path, "e-pd", "--mm-cache-dir", str(cache))
    try:
        first = chat_text(server, messages, max_tokens=8)
        assert chat_text(server, messages, max_tokens=8) == first
        assert server.metric_sum("epd:mm_cache_hits_total") == 1  # the API reads the fresh cache
        assert server.settled_sum("epd:encoder_images_total") == 1
        assert server.log().count("set aside") == 1
        # /metrics tells it too: one worker set the file aside, and every worker serves with the fresh cache
        assert server.settled_sum("epd:mm_cache_set_aside_total") == 1
        assert server.metric_sum("epd:mm_cache_serving") == 2  # the encoder and the pd worker
        assert server.metric_sum("epd:mm_cache_read_errors_total") == 0
    finally:
        assert server.stop() == 0
    assert [name.split(".corrupt-")[0] for name in set_aside(cache)] == ["data.mdb", "lock.mdb"]


def test_a_full_cache_filesystem_serves_on_and_caches_again(tiny_model, tmp_path):
    """The cache directory's filesystem (a real 8 MiB tmpfs) fills up under a
    running server: images are still answered (the tensors travel inline),
    each writer warns once, and once space is back images are cached again."""
    with mounted_tmpfs(8 << 20) as fs:
        server = start_server(tiny_model, tmp_path, "e-pd", "--mm-cache-dir", os.path.join(fs, "cache"))
        try:
            assert os.path.exists(os.path.join(fs, "cache", "data.mdb"))
            filler = fill_up(fs)  # another program took the rest of the disk
            full = [describe(image_bytes(80, 120, seed=40 + i)) for i in range(3)]
            texts = [chat_text(server, messages, max_tokens=4) for messages in full]
            assert chat_text(server, full[0], max_tokens=4) == texts[0]
            assert server.metric_sum("epd:mm_cache_hits_total") == 0  # nothing got in
            # each image's write failed for room on the encoder (and the pd worker's copy of it inline)
            assert server.settled_sum("epd:mm_cache_space_failures_total") >= 3
            assert server.metric_sum("epd:mm_cache_skipped_puts_total") >= 3
            os.remove(filler)  # space comes back
            again = describe(image_bytes(80, 120, seed=50))
            assert chat_text(server, again, max_tokens=4) == chat_text(server, again, max_tokens=4)
            assert server.metric_sum("epd:mm_cache_hits_total") == 1
            log = server.log()
            assert 1 <= log.count("the cache filesystem is full") <= 2, log  # the encoder and the pd worker
            assert "Traceback" not in log and "Input/output error" not in log
        finally:
            assert server.stop() == 0
