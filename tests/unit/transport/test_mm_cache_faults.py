"""A damaged cache file never blocks serving (issue 33, item 7): a writer
sets it aside and continues with a fresh cache, one writer only however many
open it at once; a reader continues without it; a read that LMDB fails at run
time is one miss. Every file here is a real LMDB file, really damaged."""
import logging
import multiprocessing as mp

import pytest
import torch

from epd.transport.embedding_cache.mm_cache import MMCache, mm_hash
from epd.transport.embedding_cache.mm_entry import MMEntry
from testkit.mm_cache_damage import garble_meta_fields, garble_meta_pages, garble_tree_pages, set_aside

FP = "test-model"
MiB = 1 << 20
DAMAGES = [garble_meta_pages, garble_meta_fields, garble_tree_pages]


def key(i: int) -> str:
    return mm_hash(f"image-{i}".encode(), FP, {"patch_size": 16})


def entry(i: int) -> MMEntry:
    return MMEntry(torch.full((8, 16), float(i)), {"deepstack.0": torch.full((8, 16), -float(i))}, {"grid_thw": (1, 4, 8)})


def fill(path, num_entries: int = 5) -> None:
    with MMCache(path, 16 * MiB, model_fingerprint=FP) as c:
        for i in range(num_entries):
            assert c.put(key(i), entry(i))


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda f: f.__name__)
def test_a_writer_sets_a_corrupt_file_aside_and_serves_on(tmp_path, damage, caplog):
    path = tmp_path / "mm"
    fill(path)
    damage(path)
    damaged = (path / "data.mdb").read_bytes()
    with caplog.at_level(logging.WARNING, logger="epd.transport.embedding_cache.mm_cache"):
        with MMCache(path, 16 * MiB, model_fingerprint=FP) as c:
            assert c.is_open and len(c) == 0 and c.get(key(0)) is None  # fresh and empty
            assert c.put(key(9), entry(9)) and torch.equal(c.get(key(9)).embeddings, entry(9).embeddings)
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "set aside" in warning.getMessage() and "fresh" in warning.getMessage()
    [data, lock] = set_aside(path)
    assert data.startswith("data.mdb.corrupt-") and lock.startswith("lock.mdb.corrupt-")
    assert (path / data).read_bytes() == damaged  # kept as it was, for whoever wants to look
    with MMCache(path, 16 * MiB, model_fingerprint=FP) as c:  # the fresh cache is a healthy one
        assert len(c) == 1 and c.get(key(9)) is not None
    assert len(set_aside(path)) == 2


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda f: f.__name__)
def test_a_reader_runs_without_a_corrupt_cache(tmp_path, damage, caplog):
    path = tmp_path / "mm"
    fill(path)
    damage(path)
    damaged = (path / "data.mdb").read_bytes()
    with caplog.at_level(logging.WARNING, logger="epd.transport.embedding_cache.mm_cache"):
        with MMCache(path, 16 * MiB, readonly=True, model_fingerprint=FP) as r:
            assert not r.is_open
            assert r.get(key(0)) is None and not r.contains(key(0)) and key(1) not in r
            assert len(r) == 0 and r.total_bytes == 0 and r.put(key(0), entry(0)) is False
    assert "serves without it" in caplog.text
    assert set_aside(path) == [] and (path / "data.mdb").read_bytes() == damaged  # readers rename nothing


def test_many_writers_set_a_corrupt_file_aside_once(tmp_path):
    """Four processes open the same damaged cache at the same moment: one set-aside,
    and all four share the one fresh cache (each reads the others' entries)."""
    import testkit.mm_cache_worker as worker

    path = tmp_path / "mm"
    fill(path)
    garble_tree_pages(path)
    ctx = mp.get_context("spawn")
    num_procs = 4
    barrier, results = ctx.Barrier(num_procs), ctx.Queue()
    procs = [ctx.Process(target=worker.open_at_once, args=(str(path), i, num_procs, barrier, results))
             for i in range(num_procs)]
    for p in procs:
        p.start()
    try:
        assert sorted(results.get(timeout=120) for _ in procs) == ["ok"] * num_procs
    finally:
        worker.join_or_kill(procs)
    assert len([name for name in set_aside(path) if name.startswith("data.mdb")]) == 1
    with MMCache(path, 16 * MiB, model_fingerprint=worker.FINGERPRINT) as c:
        assert len(c) == num_procs


def test_a_read_that_lmdb_fails_is_one_miss(tmp_path, caplog):
    """The file damaged under an open cache: lookups miss, puts are skipped,
    the stats and close still work, and the warning comes once."""
    path = tmp_path / "mm"
    with MMCache(path, 16 * MiB, model_fingerprint=FP) as c:
        for i in range(5):
            assert c.put(key(i), entry(i))
        garble_tree_pages(path)  # the map shares the page cache: the open handle sees it
        with caplog.at_level(logging.WARNING, logger="epd.transport.embedding_cache.mm_cache"):
            for _ in range(3):
                assert c.get(key(1)) is None and not c.contains(key(2))
            assert c.total_bytes == 0 and isinstance(len(c), int)
            assert c.put(key(7), entry(7)) is False
            c.flush()
        assert c.stats.read_errors >= 6 and c.stats.skipped_puts == 1
    assert caplog.text.count("a read failed") == 1
