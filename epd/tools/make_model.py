"""`epd make-model`: write a random-weight checkpoint in Hugging Face format, of
any family EPD serves, from a preset of the family's (its package's
presets.py: `PRESETS`, and `write_checkpoint(out, preset, seed)`).

Nothing can be downloaded here, so every checkpoint we test or benchmark on is
made locally with transformers' own config and model classes: the weights are
transformers' random init, the tokenizer a byte-level BPE trained on a
built-in corpus with the family's special tokens; the final norm is scaled so
logits are peaked: greedy argmax must never be decided by float rounding noise
(epd/families/random_checkpoints.py, what the presets share).
"""
from __future__ import annotations

import sys
from importlib import import_module
from pathlib import Path

from epd.families.registry import PACKAGES

# `--quantize`: the release formats a made checkpoint can be written in (epd/tools/quantize_model.py)
QUANTIZE_SCHEMES = ("fp8-block", "fp8-dynamic", "w8a8", "w4a16", "awq", "gptq")

def _preset_modules():
    for package in PACKAGES:
        try:
            yield import_module(f"epd.families.{package}.presets")
        except ModuleNotFoundError as exc:
            if exc.name != f"epd.families.{package}.presets":
                raise


def all_presets() -> dict[str, object]:
    """Every family's presets by name."""
    return {name: preset for module in _preset_modules() for name, preset in module.PRESETS.items()}


def make_model(out_dir: str | Path, preset="tiny", seed: int = 0, quantize: str | None = None) -> Path:
    """Writes a random-weight checkpoint to `out_dir` and returns its path.
    `preset` is a preset's name or a family's preset object (tests build variants);
    `quantize`: a release format its language model's linears are then written in
    (epd/tools/quantize_model.py)."""
    if isinstance(preset, str):
        presets = all_presets()
        if preset not in presets:
            raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(presets)}")
        preset = presets[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sys.modules[type(preset).__module__].write_checkpoint(out, preset, seed)
    if quantize is not None:
        from epd.tools.quantize_model import quantize_model

        quantize_model(out, quantize)
    return out
