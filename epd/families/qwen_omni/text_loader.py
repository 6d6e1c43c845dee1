"""Qwen2.5-Omni thinker's language model: Qwen2.5-VL's decoder (qwen_vl/), read from `thinker.model.*`."""
from __future__ import annotations

from pathlib import Path

import torch

from epd.families.qwen_omni.family import tmrope_positions
from epd.families.qwen_omni.thinker_config import strip_thinker, thinker_config
from epd.families.qwen_vl.text_configs import qwen2_5_vl_config
from epd.families.qwen_vl.text_loader import load_text_model as load_qwen_text_model
from epd.transport.weights.checkpoint import piece_name


def _describe(param: str, shard: int | None) -> str:
    """The release's name of (our parameter, fused piece): `thinker.model.*`, `thinker.lm_head.weight`."""
    name = "thinker." + param
    return name if shard is None else piece_name(name, shard)


def load_text_model(model_dir: str | Path, hf_config, dtype: torch.dtype, device: str | torch.device = "cpu"):
    thinker = thinker_config(hf_config)
    return load_qwen_text_model(model_dir, thinker, dtype, device, cfg=qwen2_5_vl_config(thinker),
                                positions=tmrope_positions(hf_config), rename=strip_thinker, describe=_describe)
