"""The checkout the experiments run from. A child process that runs
`python -m bench.dev.NAME` gets the checkout's root on its PYTHONPATH, so it
starts wherever its parent did (a test runner's folder, a network namespace)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def python_m(name: str) -> list[str]:
    """`python -m bench.dev.NAME` with this interpreter; run it with `checkout_env()`."""
    return [sys.executable, "-m", f"bench.dev.{name}"]


def checkout_env(env: dict | None = None) -> dict:
    """`env` (default: this process's) with the checkout's root first on PYTHONPATH."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env
