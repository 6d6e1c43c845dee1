"""The embedding cache's LMDB environment: opening it, and setting a corrupt
one aside so that a damaged file never blocks serving (the cache is disposable).

Several processes open one directory at once: every worker writable, each API
process read-only. Only a writer sets a corrupt cache aside, and only one:

* Every open holds a shared `flock` on `<dir>/open.lock`; setting aside holds
  it exclusively. So no process is half-way through an open while the files
  are renamed: LMDB opens lock.mdb, then data.mdb, and a rename in between
  would pair one process's old lock file with another's new data file, two
  writers with no common writer mutex (the way a cache really gets corrupted).
* A writer whose open failed drops its shared lock, takes the exclusive one
  and opens again. If that works, another writer set the corrupt files aside
  meanwhile (or the fault was passing) and it uses the fresh cache it finds.
  Only if it fails again does it rename data.mdb and lock.mdb to
  `<name>.corrupt-<UTC time>` and open a fresh environment, with one warning.
  Two writers that find the same corrupt file therefore set it aside once:
  the second one's re-open under the exclusive lock finds the first one's
  fresh cache. (A bare atomic rename would not do: the second writer could
  rename the fresh cache the first had just made and was already using.)
* If the fresh open fails too, the file was not the fault (no address space
  for the map, a read-only disk, ...): the files are renamed back and the
  process runs without a cache (`open_env` returns None).
* A reader never renames anything: it runs without the cache.
* `flock` is released when its process dies: a crash never leaves the
  directory locked.

A process that opened the environment before another one found it corrupt
keeps its handle on the renamed files; the two stop sharing entries (misses,
at worst an image encoded again), nothing worse. Corruption found later, by a
read, fails that lookup only (mm_cache.py). A file corrupt enough to crash
LMDB itself (wild pointers in inner pages) is beyond what this can catch.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from dataclasses import dataclass

import lmdb

log = logging.getLogger("epd.transport.embedding_cache.mm_cache")

LOCK_FILE = "open.lock"
LMDB_FILES = ("lock.mdb", "data.mdb")


@dataclass
class CacheEnv:
    """An open environment and its three named databases (format: mm_cache.py)."""

    env: lmdb.Environment
    entries: object  # lmdb._Database
    used: object
    meta: object
    set_aside: bool = False  # the files found here were unreadable and renamed away for this one


def open_env(path: str, map_size: int, readonly: bool) -> CacheEnv | None:
    """The cache at `path` (created when missing), a fresh one in place of a
    corrupt one (writers), or None when there is none to be had (see above)."""
    os.makedirs(path, mode=0o700, exist_ok=True)  # embeddings tell what users sent: the owner's alone
    with _flock(path, fcntl.LOCK_SH):
        try:
            return _open(path, map_size, readonly)
        except lmdb.Error as e:
            error = e
    if readonly:
        log.warning("mm cache %s cannot be opened (%s): this process serves without it "
                    "(a worker that writes it sets a corrupt one aside)", path, error)
        return None
    with _flock(path, fcntl.LOCK_EX):
        try:
            return _open(path, map_size, readonly=False)
        except lmdb.Error as e:
            error = e
        try:
            moved = _set_aside(path)
        except OSError as rename_error:
            log.warning("mm cache %s cannot be opened (%s) nor set aside (%s): this process serves "
                        "without a cache", path, error, rename_error)
            return None
        try:
            cache_env = _open(path, map_size, readonly=False)
        except lmdb.Error as fresh_error:
            _put_back(path, moved)
            log.warning("mm cache %s cannot be opened (%s), nor a fresh one in its place (%s): "
                        "this process serves without a cache", path, error, fresh_error)
            return None
    log.warning("mm cache %s was unreadable (%s): set aside as %s; serving on with a fresh, empty cache "
                "(delete the set-aside files when no longer needed)", path, error,
                ", ".join(os.path.basename(new) for _, new in moved) or "nothing")
    cache_env.set_aside = bool(moved)
    return cache_env


def _open(path: str, map_size: int, readonly: bool) -> CacheEnv:
    if readonly and not os.path.exists(os.path.join(path, "data.mdb")):
        # no writer has created it yet: create it, then open it read-only
        _open(path, map_size, readonly=False).env.close()
    env = lmdb.open(path, map_size=map_size, subdir=True, readonly=readonly, lock=True,
                    readahead=False, max_dbs=3, max_readers=512, mode=0o600)
    try:
        dbs = [env.open_db(name, create=not readonly) for name in (b"entries", b"used", b"meta")]
        with env.begin() as txn:  # touch every root page: a damaged one fails here, not in serving
            for db in dbs:
                with txn.cursor(db=db) as cursor:
                    cursor.first()
        return CacheEnv(env, *dbs)
    except BaseException:
        env.close()
        raise


@contextlib.contextmanager
def _flock(path: str, mode: int):
    """`mode` lock on the directory's open.lock; none where it cannot be
    created (a read-only directory: then nobody can rename files there either)."""
    try:
        fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)  # releases the lock


def _set_aside(path: str) -> list[tuple[str, str]]:
    """Rename the LMDB files to `<name>.corrupt-<UTC time>`; the (old, new) pairs renamed."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    moved = []
    for name in LMDB_FILES:
        old = os.path.join(path, name)
        if not os.path.exists(old):
            continue
        new, n = f"{old}.corrupt-{stamp}", 1
        while os.path.exists(new):
            n += 1
            new = f"{old}.corrupt-{stamp}-{n}"
        os.rename(old, new)
        moved.append((old, new))
    return moved


def _put_back(path: str, moved: list[tuple[str, str]]) -> None:
    for name in LMDB_FILES:  # whatever the failed fresh open left
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(path, name))
    for old, new in moved:
        os.rename(new, old)
