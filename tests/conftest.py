"""Shared fixtures: a tiny random Qwen3-VL checkpoint made once per session."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from epd.tools.make_model import make_model

    return str(make_model(tmp_path_factory.mktemp("ckpt") / "tiny", preset="tiny", seed=0))


@pytest.fixture(scope="session")
def tiny_draft(tiny_model, tmp_path_factory) -> str:
    """A draft model for `tiny_model` (speculative decoding's draft_model): its first 2 of 3 layers."""
    from epd.tools.make_draft import make_draft

    return str(make_draft(tiny_model, tmp_path_factory.mktemp("ckpt") / "tiny-draft", num_layers=2))
