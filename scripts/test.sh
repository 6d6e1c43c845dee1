#!/usr/bin/env bash
# Runs the whole test suite in ./.venv (created on first use).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh" dev
cd "$ROOT"
exec python -m pytest -q "$@"
