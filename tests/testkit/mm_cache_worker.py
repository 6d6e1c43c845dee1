"""Child-process body for the multi-process cache test (a module so spawn can import it)."""

from __future__ import annotations

import time

import torch

from epd.transport.embedding_cache.mm_cache import MMCache, mm_hash
from epd.transport.embedding_cache.mm_entry import MMEntry

FINGERPRINT = "test-model"


def key_of(i: int) -> str:
    return mm_hash(i.to_bytes(4, "little"), FINGERPRINT, {"patch_size": 16})


def entry_of(i: int) -> MMEntry:
    """Entry i: every element equals i, so any reader can check what it got."""
    return MMEntry(torch.full((8, 16), float(i)), {"deepstack.0": torch.full((8, 16), float(-i))}, {"grid_thw": (1, 4, 8)})


def check_new(cache: MMCache, pending: set[int]) -> None:
    """Remove from `pending` every entry now readable, checking its contents."""
    for i in list(pending):
        got = cache.get(key_of(i))
        if got is not None:
            assert torch.equal(got.embeddings, entry_of(i).embeddings), f"entry {i} differs"
            assert torch.equal(got.extras["deepstack.0"], entry_of(i).extras["deepstack.0"])
            pending.discard(i)


def wait_until_seen(cache: MMCache, pending: set[int], timeout_s: float, poll_s: float) -> None:
    """Until every entry of `pending` is readable (and right); fails after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        check_new(cache, pending)
        time.sleep(poll_s)
    assert not pending, f"never saw {sorted(pending)}"


def join_or_kill(procs) -> None:
    """The parent's side: every child joined (killed if it hangs)."""
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()


def run(path: str, max_bytes: int, mine: list[int], theirs: list[int], results) -> None:
    """Write `mine`, then read until all of `theirs` appear with the right contents."""
    try:
        cache = MMCache(path, max_bytes, model_fingerprint=FINGERPRINT,
                        touch_interval_s=0.0)
        for i in mine:
            assert cache.put(key_of(i), entry_of(i)), f"put {i} failed"
        wait_until_seen(cache, set(theirs), timeout_s=30, poll_s=0.005)
        cache.close()
        results.put("ok")
    except BaseException as e:  # report any failure to the parent
        results.put(f"{type(e).__name__}: {e}")


def open_at_once(path: str, index: int, num_procs: int, barrier, results) -> None:
    """Open the cache at `path` when every sibling does, put entry `index`, then
    wait until the entries of all `num_procs` siblings are readable."""
    try:
        barrier.wait(timeout=60)
        cache = MMCache(path, 16 << 20, model_fingerprint=FINGERPRINT)
        assert cache.is_open, "no cache"
        assert cache.put(key_of(index), entry_of(index)), f"put {index} failed"
        wait_until_seen(cache, set(range(num_procs)), timeout_s=60, poll_s=0.01)  # one shared cache
        cache.close()
        results.put("ok")
    except BaseException as e:  # report any failure to the parent
        results.put(f"{type(e).__name__}: {e}")
