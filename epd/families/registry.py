"""The model families EPD serves, told apart by a checkpoint's config.json.

Each package in `PACKAGES` lists its families in its `family.py` (`FAMILIES`);
adding a family is adding its package's name here. `check_family` runs before
anything else opens a checkpoint, so an unknown family stops start-up with a
message naming the supported ones. Torch-free: the API process reads it.
"""
from __future__ import annotations

import json
from importlib import import_module
from pathlib import Path

from epd.families.model_family import ModelFamily, UnsupportedModelError

__all__ = ["FAMILIES", "ModelFamily", "UnsupportedModelError", "check_family", "family_of", "get_family",
           "load_hf_config", "served_config", "supported_families"]

PACKAGES = ("qwen_vl", "gemma3", "internvl", "glm4v", "qwen3_5", "qwen_omni")

FAMILIES: dict[str, ModelFamily] = {f.model_type: f for package in PACKAGES
                                    for f in import_module(f"epd.families.{package}.family").FAMILIES}


def supported_families() -> str:
    return ", ".join(f"{f.name} (model_type {f.model_type!r})" for f in FAMILIES.values())


def get_family(model_type: str | None, architectures=()) -> ModelFamily:
    """The family of a checkpoint by `model_type`, else by its architecture name."""
    family = FAMILIES.get(model_type or "")
    if family is None:
        family = next((f for f in FAMILIES.values() if f.architecture in (architectures or ())), None)
    if family is None:
        what = f"model_type {model_type!r}" + (f" ({', '.join(architectures)})" if architectures else "")
        raise UnsupportedModelError(f"{what} is not supported; EPD serves {supported_families()}")
    return family


def check_family(model_dir: str | Path) -> ModelFamily:
    """Reads config.json itself (before transformers, which may not know the
    type either) and returns the checkpoint's family, or raises
    UnsupportedModelError naming the supported ones."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{model_dir} is not a checkpoint directory (no config.json)")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UnsupportedModelError(f"{path}: unreadable config ({exc})") from None
    if not isinstance(cfg, dict):
        raise UnsupportedModelError(f"{path}: not a JSON object")
    archs = cfg.get("architectures") or []
    return get_family(cfg.get("model_type"), tuple(a for a in archs if isinstance(a, str)))


def family_of(hf_config) -> ModelFamily:
    """The family of a loaded transformers config."""
    return get_family(getattr(hf_config, "model_type", None), tuple(getattr(hf_config, "architectures", None) or ()))


def served_config(hf_config):
    """The part of a loaded transformers config EPD serves: a whole Qwen2.5-Omni
    checkpoint's thinker (`ModelFamily.served_config`), else the config itself."""
    family = family_of(hf_config)
    return hf_config if family.served_config is None else family.served_config(hf_config)


def load_hf_config(model_dir: str | Path):
    """transformers' config of a checkpoint, the part EPD serves (`served_config`)."""
    from transformers import AutoConfig

    return served_config(AutoConfig.from_pretrained(str(model_dir)))
