"""Random checkpoints of the newer families with shapes unlike the presets:
odd head counts, a vocabulary padded beyond the tokenizer, an untied head, a
dense layer among the MoE ones, ragged vision windows. Made once per test
process (nothing is downloaded)."""
from __future__ import annotations

import atexit
import dataclasses
import json
import shutil
import tempfile
from functools import lru_cache

from epd.families.glm4v.presets import PRESETS as GLM_PRESETS
from epd.families.qwen_vl.presets import PRESETS
from epd.tools.make_model import make_model

FAMILY_VARIANTS = {
    # 5 query heads over 1 KV head, 6 experts with 3 active, layer 1 dense, one deepstack layer.
    "qwen3_vl_moe": dataclasses.replace(
        PRESETS["qwen3-vl-moe-tiny"], hidden_size=80, num_heads=5, num_kv_heads=1, head_dim=16,
        intermediate_size=96, mrope_section=(2, 3, 3), vocab_size=1100, num_experts=6, num_experts_per_tok=3,
        moe_intermediate_size=24, mlp_only_layers=(1,), vision_depth=2, vision_hidden=48, vision_heads=3,
        vision_intermediate=72, num_position_embeddings=49, deepstack_indexes=(1,)),
    # head_dim 80 / 5 = 16, contiguous M-RoPE sections, windows of 3x3 merged tokens, two full-attention blocks.
    "qwen2_5_vl": dataclasses.replace(
        PRESETS["qwen2.5-vl-tiny"], hidden_size=80, num_heads=5, num_kv_heads=1, head_dim=16,
        intermediate_size=96, mrope_section=(2, 2, 4), vocab_size=1100, vision_depth=3, vision_hidden=48,
        vision_heads=3, vision_intermediate=72, window_size=84, fullatt_block_indexes=(0, 2)),
    # head_dim 80 / 5 = 16: 8 rotary dims, sections of 1, 1 and 2 frequencies; 5 query heads over 1 KV head.
    "glm4v": dataclasses.replace(
        GLM_PRESETS["glm4v-tiny"], hidden_size=80, num_heads=5, num_kv_heads=1, intermediate_size=96,
        mrope_section=(1, 1, 2), vocab_size=1100, vision_depth=2, vision_hidden=48, vision_heads=3,
        vision_intermediate=72),
    # head_dim 24 (not 80 / 5), 12 rotary dims; two dense layers then two MoE layers of 12 experts in 3
    # groups (2 of them open), 3 active, 2 shared; a tied head.
    "glm4v_moe": dataclasses.replace(
        GLM_PRESETS["glm4v-moe-tiny"], hidden_size=80, num_layers=4, num_heads=5, num_kv_heads=1, head_dim=24,
        mrope_section=(2, 2, 2), vocab_size=1100, first_k_dense_replace=2, num_experts=12, num_experts_per_tok=3,
        num_expert_groups=3, topk_expert_groups=2, num_shared_experts=2, moe_intermediate_size=24,
        tie_word_embeddings=True, vision_depth=2, vision_hidden=48, vision_heads=3, vision_intermediate=72),
}


@lru_cache(maxsize=None)
def family_checkpoint(family: str) -> str:
    path = tempfile.mkdtemp(prefix=f"epd-{family}-")
    atexit.register(shutil.rmtree, path, True)  # gone with the test process
    return str(make_model(path, FAMILY_VARIANTS[family], seed=11))


# How start-up names the supported families when a checkpoint is of none of them.
SUPPORTED = ("Qwen3-VL (model_type 'qwen3_vl')", "Qwen3-VL-MoE (model_type 'qwen3_vl_moe')",
             "Qwen2.5-VL (model_type 'qwen2_5_vl')", "Gemma 3 (model_type 'gemma3')",
             "InternVL (model_type 'internvl')", "GLM-4.1V (model_type 'glm4v')",
             "GLM-4.5V (model_type 'glm4v_moe')", "Qwen3.5 (model_type 'qwen3_5')",
             "Qwen3.5-MoE (model_type 'qwen3_5_moe')", "Qwen2.5-Omni (model_type 'qwen2_5_omni')",
             "Qwen2.5-Omni thinker (model_type 'qwen2_5_omni_thinker')")


def config_only_checkpoint(path, config: dict) -> str:
    """A checkpoint directory holding only this config.json (enough for the family check)."""
    (path / "config.json").write_text(json.dumps(config))
    return str(path)
