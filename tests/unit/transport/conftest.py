"""Fixtures shared by the transport tests."""

from __future__ import annotations

import shutil
import tempfile

import pytest


@pytest.fixture
def ipc_dir():
    """A short directory for ipc sockets (sun_path is only 107 bytes)."""
    path = tempfile.mkdtemp(prefix="epd-t-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)
