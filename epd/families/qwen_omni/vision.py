"""Qwen2.5-Omni thinker's vision side: Qwen2.5-VL's tower and image processor (qwen_vl/vision.py)
under the thinker's names (`thinker.visual.*`, q / k / v apart where Qwen2.5-VL fuses them)."""
from __future__ import annotations

import re

from epd.families.qwen_omni.thinker_config import strip_thinker, thinker_config
from epd.families.qwen_vl.vision import QwenVision, load_vision_tower

_PREFIXES = ("model.visual.", "visual.")
_QKV = re.compile(r"(blocks\.\d+\.attn)\.([qkv])\.(weight|bias)$")


def _vision_rule(name: str):
    name = strip_thinker(name)
    for prefix in _PREFIXES:
        if name is not None and name.startswith(prefix):
            rest = name[len(prefix):]
            m = _QKV.match(rest)
            return (f"{m[1]}.qkv.{m[3]}", "qkv".index(m[2])) if m else (rest, None)
    return None


def load_omni_tower(model_dir, hf_config, dtype, device="cpu"):
    thinker = thinker_config(hf_config)
    vc = thinker.vision_config
    fused = {f"blocks.{i}.attn.qkv.{kind}": [vc.hidden_size] * 3 for i in range(vc.depth)
             for kind in ("weight", "bias")}
    return load_vision_tower(model_dir, thinker, dtype, device, model_type="qwen2_5_vl", rule=_vision_rule,
                             fused=fused, describe=_describe)


def _describe(param: str, shard: int | None) -> str:
    """The release's name of (our parameter, fused piece): q / k / v apart under `thinker.visual.`."""
    if shard is not None:
        param = param.replace(".attn.qkv.", f".attn.{'qkv'[shard]}.")
    return "thinker.visual." + param


def load_vision(model_dir, hf_config, dtype, device="cpu", processor_kwargs=None) -> QwenVision:
    return QwenVision(model_dir, hf_config, dtype, device, processor_kwargs, load_tower=load_omni_tower)
