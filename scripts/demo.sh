#!/usr/bin/env bash
# Serves a built-in demo checkpoint (random weights, made on first run) with
# `epd serve` on http://127.0.0.1:8000/v1. Extra arguments go to `epd serve`
# (e.g. `bash scripts/demo.sh --mode aggregated --port 9000`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh" ""  # no extras (and not this script's arguments)
DEMO="$ROOT/.demo/tiny"
if [ ! -f "$DEMO/config.json" ]; then
    epd make-model "$DEMO" --preset tiny
fi
exec epd serve "$DEMO" --served-model-name epd-demo --mm-cache-dir "$ROOT/.demo/mm-cache" "$@"
