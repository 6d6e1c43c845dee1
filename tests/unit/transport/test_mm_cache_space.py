"""A full cache filesystem never silently disables caching (issue 33, item 9):
on a real 2 MiB tmpfs the cache keeps under what the filesystem holds, a
filesystem filled by someone else skips puts with one warning and a
counter, and caching resumes when space comes back, restart or not."""
import logging
import os

import pytest
import torch

from epd.transport.embedding_cache.mm_cache import MMCache, mm_hash
from epd.transport.embedding_cache.mm_entry import MMEntry, encode_entry
from testkit.small_fs import fill_up, mounted_tmpfs

FP = "test-model"
MiB = 1 << 20
FS_BYTES = 2 * MiB
CAP_BYTES = 64 * MiB  # --mm-cache-gb far beyond the filesystem


def key(i: int) -> str:
    return mm_hash(f"image-{i}".encode(), FP, {"patch_size": 16})


def entry(i: int) -> MMEntry:
    """~100 KiB: a 2 MiB filesystem holds about 20."""
    return MMEntry(torch.full((200, 128), float(i)), {}, {"grid_thw": (1, 20, 40)})


@pytest.fixture
def small_fs():
    """A real 2 MiB filesystem."""
    with mounted_tmpfs(FS_BYTES) as path:
        yield path


def test_eviction_keeps_under_what_the_filesystem_holds(small_fs):
    size = len(encode_entry(entry(0), FP))
    with MMCache(os.path.join(small_fs, "mm"), CAP_BYTES, model_fingerprint=FP) as c:
        totals = []
        for i in range(60):  # three times what the filesystem holds
            assert c.put(key(i), entry(i)), f"put {i}"
            assert torch.equal(c.get(key(i)).embeddings, entry(i).embeddings)
            totals.append(c.total_bytes)
        assert max(totals) <= c.budget_bytes < FS_BYTES // 2
        assert c.stats.space_failures == 0 and c.stats.evictions > 0
        assert len(c) * size == c.total_bytes >= c.budget_bytes // 2


def test_a_full_filesystem_skips_puts_warns_once_and_caching_resumes(small_fs, caplog):
    path = os.path.join(small_fs, "mm")
    with MMCache(path, CAP_BYTES, model_fingerprint=FP) as c:
        assert c.put(key(0), entry(0))
        filler = fill_up(small_fs)  # another program took the rest of the disk
        with caplog.at_level(logging.WARNING, logger="epd.transport.embedding_cache.mm_cache"):
            stored = [c.put(key(i), entry(i)) for i in range(1, 31)]  # no exception escapes
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "the cache filesystem is full" in warnings[0], warnings
        assert not all(stored) and c.stats.space_failures == stored.count(False) >= 15
        os.remove(filler)  # space comes back
        for i in range(100, 110):
            assert c.put(key(i), entry(i)) and c.get(key(i)) is not None
        assert c.stats.space_failures == stored.count(False)  # none since


def test_a_restart_on_a_full_filesystem_caches_new_images(small_fs):
    """The cache filled its share, then the disk filled up: after a restart new
    images still get in (the budget counts the cache's own file), old ones go."""
    path = os.path.join(small_fs, "mm")
    with MMCache(path, CAP_BYTES, model_fingerprint=FP) as c:
        for i in range(30):
            c.put(key(i), entry(i))
    fill_up(small_fs)
    with MMCache(path, CAP_BYTES, model_fingerprint=FP) as c:
        for i in range(100, 120):
            assert c.put(key(i), entry(i)), f"put {i}"
            assert c.get(key(i)) is not None
        assert c.stats.space_failures == 0
