"""transformers with the compressed-tensors package as the reference for compressed-tensors
checkpoints (FP8-dynamic, W8A8, W4A16), run in a child process.

Installed into the venv, compressed-tensors would be taken up by transformers for every
test; scripts/env.sh installs it with --no-deps (and loguru, its logger) into
.venv/reference-compressed-tensors, and only this child puts that folder on sys.path.
The child loads the checkpoint decompressed (`CompressedTensorsConfig(dequantize=True)`:
the package's own unpacking and scales) and writes the language model's linear weights.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

CT_DIR = Path(__file__).resolve().parents[2] / ".venv" / "reference-compressed-tensors"


def reference_available() -> bool:
    return (CT_DIR / "compressed_tensors").is_dir()


def decompressed_weights(model_dirs: list[Path], names: list[str], work: Path) -> list[dict[str, torch.Tensor]]:
    """Per checkpoint (one child process for all: its imports take seconds), {name: float32
    weight} of transformers' decompressed model, for module names such as
    "model.language_model.layers.0.mlp.down_proj"."""
    import json

    from safetensors.torch import load_file

    work.mkdir(parents=True, exist_ok=True)
    outs = [work / f"weights-{i}.safetensors" for i in range(len(model_dirs))]
    job = {"model_dirs": [str(d) for d in model_dirs], "outs": [str(o) for o in outs], "names": names}
    proc = subprocess.run([sys.executable, __file__, json.dumps(job)], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"compressed-tensors reference failed:\n{proc.stderr[-4000:]}")
    return [load_file(str(out)) for out in outs]


def _main(job: dict) -> None:
    sys.path.insert(0, str(CT_DIR))
    from safetensors.torch import save_file
    from transformers import AutoModelForImageTextToText, CompressedTensorsConfig

    for model_dir, out in zip(job["model_dirs"], job["outs"]):
        model = AutoModelForImageTextToText.from_pretrained(
            model_dir, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True))
        modules = dict(model.named_modules())
        save_file({name: modules[name].weight.detach().float().contiguous() for name in job["names"]}, out)


if __name__ == "__main__":
    import json

    _main(json.loads(sys.argv[1]))
