"""Damage a real LMDB embedding cache on disk, as a bad disk or a stray write would."""
from __future__ import annotations

import glob
import os
import struct

PAGE = 4096
P_BRANCH, P_LEAF = 0x01, 0x02


def garble_meta_pages(path) -> None:
    """Both meta pages (the first two) overwritten with garbage: MDB_INVALID."""
    with open(os.path.join(path, "data.mdb"), "r+b") as f:
        f.write(os.urandom(2 * PAGE))


def garble_meta_fields(path) -> None:
    """The magic kept, the fields after it garbage: EINVAL from the map size."""
    with open(os.path.join(path, "data.mdb"), "r+b") as f:
        for page in (0, 1):
            f.seek(page * PAGE + 24)
            f.write(b"\xff" * (PAGE - 24))


def garble_tree_pages(path) -> None:
    """Every branch and leaf page marked as some other kind: MDB_CORRUPTED, the issue's error."""
    data = os.path.join(path, "data.mdb")
    with open(data, "r+b") as f:
        for page in range(2, os.path.getsize(data) // PAGE):
            f.seek(page * PAGE + 10)  # mp_flags, after mp_pgno (8) and mp_pad (2)
            (flags,) = struct.unpack("<H", f.read(2))
            if flags & (P_BRANCH | P_LEAF):
                f.seek(page * PAGE + 10)
                f.write(struct.pack("<H", 0x10))


def set_aside(path) -> list[str]:
    """Names of the files a writer set aside in cache directory `path`."""
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "*.corrupt-*")))
