"""The model families the engine serves, told apart by a checkpoint's config.json.

Every family runs the same paged decoder (`qwen3_vl.Qwen3VLForCausalLM`);
what differs is how its Hugging Face text config maps onto our `TextConfig`
(q/k norms or q/k/v biases, M-RoPE layout, dense or sparse MLPs) and its
position rule (models/positions.py; all three are M-RoPE). How it writes
images and videos into a prompt, and counts an image's tokens, is its
`PromptFormat` (transport/media/prompt_format.py), which the API process asks
(torch-free). The vision towers have their own table in encoders/loader.py
(encoders cannot import the engine). `check_family` runs before anything else
opens a checkpoint, so an unknown family stops start-up with a message naming
the supported ones.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from epd.transport.media.prompt_format import PromptFormat
from epd.transport.media.qwen_vl_format import QWEN_VL_FORMAT

if TYPE_CHECKING:  # the API process asks for the family and must not load model code (torch)
    from epd.engine.models.positions import PositionRule
    from epd.engine.models.qwen3_vl import TextConfig


class UnsupportedModelError(ValueError):
    """The checkpoint is of a model family EPD does not serve."""


@dataclass(frozen=True)
class ModelFamily:
    name: str  # as people call it: "Qwen3-VL-MoE"
    model_type: str  # config.json "model_type"
    architecture: str  # config.json "architectures" entry (transformers' class)
    text_config: Callable[[object], TextConfig]  # hf config -> our decoder's config
    prompt_format: PromptFormat  # its placeholders, their expansion, its image geometry (torch-free)
    positions: Callable[[object], PositionRule]  # hf config -> where its tokens sit (models/positions.py)


def _qwen3_vl(hf_config) -> TextConfig:
    from epd.engine.models.qwen3_vl import TextConfig

    return TextConfig.from_hf(hf_config)


def _qwen3_vl_moe(hf_config) -> TextConfig:
    from epd.engine.models.qwen3_vl_moe import text_config_from_hf

    return text_config_from_hf(hf_config)


def _qwen2_5_vl(hf_config) -> TextConfig:
    from epd.engine.models.qwen2_5_vl import text_config_from_hf

    return text_config_from_hf(hf_config)


def _mrope(hf_config) -> PositionRule:
    from epd.engine.models.positions import MRopePositions

    vision = hf_config.vision_config
    return MRopePositions(vision.spatial_merge_size, float(getattr(vision, "tokens_per_second", None) or 1.0))


FAMILIES: dict[str, ModelFamily] = {f.model_type: f for f in (
    ModelFamily("Qwen3-VL", "qwen3_vl", "Qwen3VLForConditionalGeneration", _qwen3_vl, QWEN_VL_FORMAT, _mrope),
    ModelFamily("Qwen3-VL-MoE", "qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", _qwen3_vl_moe, QWEN_VL_FORMAT,
                _mrope),
    ModelFamily("Qwen2.5-VL", "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", _qwen2_5_vl, QWEN_VL_FORMAT, _mrope),
)}


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
