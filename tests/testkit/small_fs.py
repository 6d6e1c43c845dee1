"""A real, small filesystem for tests of a full disk: a tmpfs mounted for the
test (root only: skipped with the reason elsewhere), and a file that fills it."""
from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import tempfile

import pytest


@contextlib.contextmanager
def mounted_tmpfs(size_bytes: int):
    """A directory with a `size_bytes` tmpfs mounted on it, unmounted afterwards."""
    path = tempfile.mkdtemp(prefix="epd-smallfs-")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0700", "tmpfs", path],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        os.rmdir(path)
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)
        os.rmdir(path)


def fill_up(path: str) -> str:
    """A file that takes every free byte of the filesystem under `path`."""
    filler = os.path.join(path, "filler")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 512)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler
