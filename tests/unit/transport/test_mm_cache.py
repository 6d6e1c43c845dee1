import logging
import multiprocessing as mp
import time

import lmdb
import msgpack
import pytest
import torch

from epd.transport.embedding_cache.mm_cache import MMCache, mm_hash
from epd.transport.embedding_cache.mm_entry import MMEntry, encode_entry

FP = "test-model"
MiB = 1 << 20


def key(i: int) -> str:
    return mm_hash(f"image-{i}".encode(), FP, {"patch_size": 16})


def entry(seed: int, n: int = 8, hidden: int = 16, dtype=torch.float32,
          num_deepstack: int = 2) -> MMEntry:
    g = torch.Generator().manual_seed(seed)
    return MMEntry(torch.randn(n, hidden, generator=g).to(dtype),
                   {f"deepstack.{i}": torch.randn(n, hidden, generator=g).to(dtype) for i in range(num_deepstack)},
                   {"grid_thw": (1, 2 * n, 2)})


def same(a: MMEntry, b: MMEntry) -> bool:
    return (a.meta == b.meta and a.embeddings.dtype == b.embeddings.dtype
            and torch.equal(a.embeddings, b.embeddings) and list(a.extras) == list(b.extras)
            and all(torch.equal(x, y) for x, y in zip(a.extras.values(), b.extras.values())))


@pytest.fixture
def cache(tmp_path):
    with MMCache(tmp_path / "mm", 16 * MiB, model_fingerprint=FP) as c:
        yield c


def _raw_put(path, raw_key: bytes, value: bytes) -> None:
    env = lmdb.open(str(path), max_dbs=3, subdir=True)
    with env.begin(write=True) as txn:
        txn.put(raw_key, value, db=env.open_db(b"entries", txn=txn))
    env.close()


def test_mm_hash_is_canonical_and_sensitive():
    h = mm_hash(b"img", FP, {"a": 1, "b": {"y": [1, 2], "x": 0.5}})
    assert len(h) == 64 and int(h, 16) >= 0
    assert h == mm_hash(b"img", FP, {"b": {"x": 0.5, "y": (1, 2)}, "a": 1})  # order-free
    assert h != mm_hash(b"img2", FP, {"a": 1, "b": {"y": [1, 2], "x": 0.5}})
    assert h != mm_hash(b"img", "other", {"a": 1, "b": {"y": [1, 2], "x": 0.5}})
    assert h != mm_hash(b"img", FP, {"a": 2, "b": {"y": [1, 2], "x": 0.5}})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_put_get_round_trip(cache, dtype):
    e = entry(1, dtype=dtype)
    assert cache.put(key(1), e)
    got = cache.get(key(1))
    assert same(got, e) and got.created_s > 0
    assert cache.contains(key(1)) and key(1) in cache and len(cache) == 1
    got.embeddings += 1  # returned tensors are private copies
    assert same(cache.get(key(1)), e)


def test_zero_token_entry_and_no_deepstack(cache):
    e = MMEntry(torch.zeros(0, 16), {}, {"grid_thw": (1, 0, 0)})
    assert cache.put(key(2), e) and same(cache.get(key(2)), e)


def test_stats_count_hits_and_misses(cache):
    cache.put(key(1), entry(1))
    assert cache.get(key(2)) is None
    assert cache.get(key(1)) is not None
    assert cache.get(key(1)) is not None
    assert (cache.stats.queries, cache.stats.hits, cache.stats.puts) == (3, 2, 1)
    assert cache.stats.hit_rate == pytest.approx(2 / 3)


def test_duplicate_put_is_counted_once(cache):
    cache.put(key(1), entry(1))
    total = cache.total_bytes
    assert cache.put(key(1), entry(1))
    assert len(cache) == 1 and cache.total_bytes == total == len(encode_entry(entry(1), FP))


def test_survives_restart_and_is_shared_with_readers(tmp_path):
    path = tmp_path / "mm"
    with MMCache(path, 16 * MiB, model_fingerprint=FP) as c:
        for i in range(5):
            c.put(key(i), entry(i))
        total = c.total_bytes
    with MMCache(path, 16 * MiB, readonly=True, model_fingerprint=FP) as r:
        assert len(r) == 5 and r.total_bytes == total
        assert all(same(r.get(key(i)), entry(i)) for i in range(5))
        assert not r.put(key(9), entry(9))  # read-only: refused, not raised
    with MMCache(path, 16 * MiB, model_fingerprint=FP) as c:
        assert same(c.get(key(3)), entry(3))


def test_readonly_open_of_missing_cache_is_empty(tmp_path):
    with MMCache(tmp_path / "new", MiB, readonly=True, model_fingerprint=FP) as r:
        assert len(r) == 0 and r.get(key(0)) is None


def test_lru_eviction_keeps_recently_used(tmp_path):
    size = len(encode_entry(entry(0), FP))
    # room for 3.5 entries; eviction goes down to 90% of that (3.15) minus the new entry
    with MMCache(tmp_path / "mm", int(3.5 * size), model_fingerprint=FP) as c:
        for i in range(3):
            assert c.put(key(i), entry(i))
        assert c.get(key(0)) is not None  # 0 is now more recent than 1 and 2
        assert c.put(key(3), entry(3))
        assert [c.contains(key(i)) for i in range(4)] == [True, False, True, True]
        assert c.put(key(4), entry(4))  # LRU now: 2 (put), then 0 (get), 3, 4
        assert [c.contains(key(i)) for i in range(5)] == [True, False, False, True, True]
        assert c.stats.evictions == 2 and c.total_bytes == 3 * size <= c.max_bytes


def test_every_put_succeeds_under_a_small_cap(tmp_path):
    sizes = {}
    with MMCache(tmp_path / "mm", 64 * 1024, model_fingerprint=FP) as c:
        for i in range(60):
            e = entry(i, n=4 + i % 13, num_deepstack=i % 3)
            sizes[i] = len(encode_entry(e, FP))
            assert c.put(key(i), e)
            assert c.total_bytes <= c.max_bytes
            if i % 4 == 0:
                c.get(key(i // 2))
            assert same(c.get(key(i)), e)  # the newest entry is never the one evicted
        assert c.stats.evictions > 0
        present = [i for i in range(60) if c.contains(key(i))]
        assert len(c) == len(present) and c.total_bytes == sum(sizes[i] for i in present)


def test_oversize_entry_is_skipped_with_a_warning(tmp_path, caplog):
    with MMCache(tmp_path / "mm", 4096, model_fingerprint=FP) as c:
        assert c.put(key(0), entry(0, n=2, hidden=4))
        with caplog.at_level(logging.WARNING, logger="epd.transport.embedding_cache.mm_cache"):
            assert c.put(key(1), entry(1, n=64, hidden=64)) is False
        assert "exceeds" in caplog.text
        assert c.stats.skipped_puts == 1 and not c.contains(key(1)) and c.contains(key(0))


def test_map_full_evicts_harder_then_skips(cache, monkeypatch):
    for i in range(4):
        cache.put(key(i), entry(i))
    real_write, calls = cache._write, []

    def flaky_write(*args):
        calls.append(args)
        if len(calls) == 1:
            raise lmdb.MapFullError("simulated")
        return real_write(*args)

    monkeypatch.setattr(cache, "_write", flaky_write)
    assert cache.put(key(9), entry(9)) and cache.contains(key(9))
    assert calls[1][2] == cache.max_bytes // 2  # second try evicts down to half

    def full_write(*args):
        raise lmdb.MapFullError("simulated")

    monkeypatch.setattr(cache, "_write", full_write)
    assert cache.put(key(10), entry(10)) is False and cache.stats.skipped_puts == 1


@pytest.mark.parametrize("make_value", [
    lambda good: b"garbage" * 10,
    lambda good: good[:-1],                     # truncated tensor bytes
    lambda good: good + b"\0" * 64,            # trailing bytes
    lambda good: good[:20],                     # truncated header
    lambda good: b"XXXXXXXX" + good[8:],        # bad magic
    lambda good: b"",
], ids=["garbage", "truncated", "padded", "short-header", "magic", "empty"])
def test_corrupt_entry_is_a_miss_and_is_deleted(tmp_path, make_value):
    path = tmp_path / "mm"
    good = encode_entry(entry(0), FP)
    with MMCache(path, 16 * MiB, model_fingerprint=FP) as c:
        c.put(key(1), entry(1))
    _raw_put(path, bytes.fromhex(key(0)), make_value(good))
    with MMCache(path, 16 * MiB, readonly=True, model_fingerprint=FP) as r:
        assert r.get(key(0)) is None and not r.contains(key(0)) and r.stats.bad_entries == 1
        assert len(r) == 2  # a reader leaves it
    with MMCache(path, 16 * MiB, model_fingerprint=FP) as c:
        assert c.get(key(0)) is None and len(c) == 1  # a writer deletes it
        assert same(c.get(key(1)), entry(1))
        assert c.put(key(0), entry(0)) and same(c.get(key(0)), entry(0))


def _format_1_value(e: MMEntry) -> bytes:
    """A value as format 1 wrote it: the grid and deepstack features as fields of their own."""
    tensors = [e.embeddings.contiguous(), *e.extras.values()]
    header = msgpack.packb({"v": 1, "fingerprint": FP, "grid_thw": list(e.meta["grid_thw"]), "created_s": 1.0,
                            "tensors": [{"dtype": "float32", "shape": list(t.shape)} for t in tensors]})
    value = b"EPDMM\x00v1" + len(header).to_bytes(4, "little") + header
    for t in tensors:
        value += b"\0" * (-len(value) % 64) + t.numpy().tobytes()
    return value


def test_a_format_1_value_is_a_miss_never_misread(tmp_path):
    path = tmp_path / "mm"
    MMCache(path, 16 * MiB, model_fingerprint=FP).close()
    _raw_put(path, bytes.fromhex(key(0)), _format_1_value(entry(0)))
    with MMCache(path, 16 * MiB, model_fingerprint=FP) as c:
        assert c.get(key(0)) is None and c.stats.bad_entries == 1 and len(c) == 0
        assert c.put(key(0), entry(0)) and same(c.get(key(0)), entry(0))


def test_corrupt_entry_is_replaced_by_put(tmp_path):
    path = tmp_path / "mm"
    MMCache(path, 16 * MiB, model_fingerprint=FP).close()
    _raw_put(path, bytes.fromhex(key(0)), b"garbage")
    with MMCache(path, 16 * MiB, model_fingerprint=FP) as c:
        assert c.put(key(0), entry(0)) and same(c.get(key(0)), entry(0))


def test_foreign_fingerprint_is_a_miss(tmp_path):
    path = tmp_path / "mm"
    with MMCache(path, 16 * MiB, model_fingerprint="model-a") as c:
        c.put(key(0), entry(0))
    with MMCache(path, 16 * MiB, model_fingerprint="model-b") as c:
        assert not c.contains(key(0)) and c.get(key(0)) is None
        assert c.stats.bad_entries == 1


def test_bad_key_is_a_value_error(cache):
    with pytest.raises(ValueError):
        cache.get("not-hex")
    with pytest.raises(ValueError):
        cache.put("ab" * 16, entry(0))


def test_two_processes_share_one_cache(tmp_path):
    import testkit.mm_cache_worker as worker

    path = str(tmp_path / "mm")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    jobs = [(list(range(0, 20)), list(range(20, 40))),  # two writers reading each other's entries
            (list(range(20, 40)), list(range(0, 20)))]
    procs = [ctx.Process(target=worker.run, args=(path, 64 * MiB, *job, results)) for job in jobs]
    for p in procs:
        p.start()
    try:
        # meanwhile this process reads both writers' entries through a read-only handle
        with MMCache(path, 64 * MiB, readonly=True, model_fingerprint=worker.FINGERPRINT) as r:
            pending, deadline = set(range(40)), time.monotonic() + 60
            while pending and time.monotonic() < deadline:
                worker.check_new(r, pending)
                time.sleep(0.01)
            assert not pending
        assert [results.get(timeout=60) for _ in procs] == ["ok", "ok"]
    finally:
        worker.join_or_kill(procs)
    with MMCache(path, 64 * MiB, model_fingerprint=worker.FINGERPRINT) as c:
        size = len(encode_entry(worker.entry_of(0), worker.FINGERPRINT))
        assert len(c) == 40 and c.total_bytes == 40 * size


def test_cache_files_are_the_owners_alone(tmp_path):
    """Issue 33, item 10: embeddings tell what users sent; a cache EPD creates is
    readable by its owner only (the directory 0700, every file 0600)."""
    import stat

    from epd.transport.embedding_cache.mm_cache import MMCache

    path = tmp_path / "cache"
    cache = MMCache(str(path), 1 << 20, model_fingerprint="f")
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
        files = sorted(p.name for p in path.iterdir())
        assert "data.mdb" in files and "lock.mdb" in files
        assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in path.iterdir()} == {name: 0o600 for name in files}
    finally:
        cache.close()
