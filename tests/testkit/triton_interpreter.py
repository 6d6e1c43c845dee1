"""Triton kernels on CPU: a test file's `test_triton_interpreted` cases run in a
subprocess with TRITON_INTERPRET=1 (the variable must be set before triton is
imported, so it cannot be switched on inside the running test session)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
REPO_ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(test_file: str, num_cases: int) -> None:
    """Runs `test_file`'s `test_triton_interpreted` under the interpreter and
    asserts that all `num_cases` passed."""
    pytest.importorskip("triton")
    if INTERPRETING:
        pytest.skip("already inside the interpreter subprocess")
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           f"{Path(test_file).resolve()}::test_triton_interpreted"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and f"{num_cases} passed" in proc.stdout, proc.stdout[-6000:] + proc.stderr[-2000:]
