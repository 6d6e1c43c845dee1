"""How many bytes of entries the embedding cache's filesystem can hold.

`--mm-cache-gb` is a cap, not a promise: on a filesystem with less room every
write used to fail (LMDB's short write reads "Input/output error") and
nothing was cached again, even after a restart. The cache keeps under

    budget_bytes = min(max_bytes, space_bytes)
    space_bytes  = (free bytes + data.mdb's own bytes - margin) / FILE_BYTES_PER_VALUE_BYTE

computed again before every put: data.mdb's own bytes count because eviction
frees pages inside it for reuse (the file never shrinks), and other files
growing or shrinking on the filesystem move the budget with them, so caching
resumes by itself when space comes back. LMDB's file holds more than the
values: pages freed by a transaction are reused only two transactions later,
copy-on-write needs new pages before old ones are freed, and readers pin old
snapshots. Churn on a small filesystem peaked at 1.6x the values (and 1.25x
already failed puts), so the values get half of the room, as the map is
sized twice `max_bytes` for the same reason. The margin (2% of the
filesystem, at most 64 MiB) is left to everyone else.
"""
from __future__ import annotations

import errno
import os
import shutil

import lmdb

FILE_BYTES_PER_VALUE_BYTE = 2
MARGIN_FRACTION = 0.02
MAX_MARGIN_BYTES = 64 << 20
# LMDB's own codes do not say "disk": a full filesystem shows as ENOSPC, as EIO
# (a short write, mdb_page_flush), as a quota or as a file-size limit.
_SPACE_ERRNOS = (errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EFBIG)


def space_bytes(path: str) -> int | None:
    """Bytes of entry values the filesystem of cache directory `path` can hold
    (formula above); None when it cannot be measured (then only the cap counts)."""
    try:
        usage = shutil.disk_usage(path)
        own_bytes = os.stat(os.path.join(path, "data.mdb")).st_blocks * 512
    except OSError:
        return None
    margin_bytes = min(MAX_MARGIN_BYTES, int(usage.total * MARGIN_FRACTION))
    return max(0, usage.free + own_bytes - margin_bytes) // FILE_BYTES_PER_VALUE_BYTE


def free_bytes(path: str) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def is_space_error(error: lmdb.Error) -> bool:
    """Whether LMDB failed a write for want of room (map or filesystem)."""
    if isinstance(error, (lmdb.MapFullError, lmdb.DiskError)):
        return True
    text = str(error)
    return any(os.strerror(code) in text for code in _SPACE_ERRNOS)
