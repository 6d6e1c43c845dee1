#!/usr/bin/env bash
# Creates ./.venv (once) and installs EPD into it, with the given extras.
# On a machine without an NVIDIA GPU, torch is pinned to the CPU build 2.13.0
# *before* anything else, so no dependency can pull a multi-GB CUDA build.
# Usage: source scripts/env.sh [extras]    e.g. `source scripts/env.sh dev`
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="${1:-}"
PY="${PYTHON:-python3}"
if [ ! -x "$ROOT/.venv/bin/python" ]; then
    "$PY" -m venv "$ROOT/.venv"
fi
# shellcheck disable=SC1091
source "$ROOT/.venv/bin/activate"
STAMP="$ROOT/.venv/.epd-installed-${EXTRAS:-base}"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ] || [ "$ROOT/scripts/env.sh" -nt "$STAMP" ]; then
    if ! python -c "import torch" 2>/dev/null; then
        if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
            pip install -q torch
        else
            pip install -q torch==2.13.0
        fi
    fi
    TARGET="$ROOT"
    [ -n "$EXTRAS" ] && TARGET="$ROOT[$EXTRAS]"
    pip install -q -e "$TARGET"
    if [[ ",$EXTRAS," == *",dev,"* ]]; then
        # The video tests' reference (transformers' video processors) needs torchvision's
        # transforms; inside the venv it would change AutoImageProcessor's pixels, so it
        # goes to its own folder, put on sys.path by the reference process alone
        # (tests/testkit/video_reference.py). Its version follows torch's (2.N -> 0.N+15).
        TV="$(python -c "import torch; v = torch.__version__.split('+')[0].split('.'); print(f'0.{int(v[1]) + 15}.*')")"
        pip install -q --no-deps --upgrade --target "$ROOT/.venv/reference-torchvision" "torchvision==$TV"
        # Speculators' config classes: the reference the EAGLE-3 head tests check our config.json
        # against (tests/testkit/speculators_reference.py). It pins transformers <= 5.19 and pulls
        # torchvision, torchaudio and datasets, so it too goes to its own folder, without its
        # dependencies: nothing in the venv changes and no torch is downloaded.
        pip install -q --no-deps --upgrade --target "$ROOT/.venv/reference-speculators" "speculators==0.9.0"
        # compressed-tensors (with loguru, its logger): transformers decompresses a compressed-tensors
        # checkpoint with it, the reference the quantized-checkpoint tests read ours against
        # (tests/testkit/compressed_tensors_reference.py). In the venv transformers would take it up for
        # every test; in its own folder only the reference's child process does.
        pip install -q --no-deps --upgrade --target "$ROOT/.venv/reference-compressed-tensors" \
            "compressed-tensors==0.20.0" "loguru==0.8.0"
    fi
    python -c "import epd, torch; print('epd env ready: torch', torch.__version__)"
    touch "$STAMP"
fi
