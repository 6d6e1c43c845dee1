"""Tiny random Qwen3.5 checkpoints (epd make-model's "qwen3.5-tiny" and "qwen3.5-moe-tiny",
presets.py), made once per session, and transformers' own model on each (the reference)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session", params=["qwen3.5-tiny", "qwen3.5-moe-tiny"])
def qwen3_5_model(request, tmp_path_factory) -> str:
    from epd.tools.make_model import make_model

    return str(make_model(tmp_path_factory.mktemp("ckpt") / request.param, request.param, seed=0))


@pytest.fixture(scope="session")
def qwen3_5_reference(qwen3_5_model):
    """transformers' Qwen3_5ForConditionalGeneration or Qwen3_5MoeForConditionalGeneration, float32."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(qwen3_5_model)
    model_cls = getattr(transformers, config.architectures[0])
    return model_cls.from_pretrained(qwen3_5_model, dtype=torch.float32).eval()
