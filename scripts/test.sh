#!/usr/bin/env bash
# Runs the whole test suite in ./.venv (created on first use), in two processes
# (pytest-xdist): the suite waits on servers' start-ups, restarts and deadlines
# about as much as it computes. Each process is given whole groups of tests that
# share a server (tests/conftest.py). EPD_TEST_PROCESSES=1: one process.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh" dev
cd "$ROOT"
PROCESSES="${EPD_TEST_PROCESSES:-2}"
PARALLEL=()
if [ "$PROCESSES" != 1 ]; then
    PARALLEL=(-n "$PROCESSES")  # whole groups each: tests/conftest.py, pytest_xdist_make_scheduler
fi
exec python -m pytest -q "${PARALLEL[@]}" "$@"
