"""A tiny random Gemma 3 checkpoint (epd make-model's "gemma3-tiny", presets.py), made once per session, and
transformers' own Gemma3ForConditionalGeneration and processor on it (the reference)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def gemma3_model(tmp_path_factory) -> str:
    from epd.tools.make_model import make_model

    return str(make_model(tmp_path_factory.mktemp("ckpt") / "gemma3-tiny", "gemma3-tiny", seed=0))


@pytest.fixture(scope="session")
def gemma3_reference(gemma3_model):
    """(transformers' model in float32, its processor)."""
    import torch
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(gemma3_model, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(gemma3_model)
