#!/usr/bin/env bash
# Runs EPD on a built-in demo checkpoint (random weights, made on first run).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh"
DEMO="$ROOT/.demo/tiny"
if [ ! -f "$DEMO/config.json" ]; then
    epd make-model "$DEMO" --preset tiny
fi
exec epd chat "$DEMO" --prompt "${1:-Describe this picture.}" --image "$ROOT/docs/demo.png" --max-tokens 24
