"""Shared fixtures: a tiny random Qwen3-VL checkpoint made once per session."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from epd.tools.make_model import make_model

    return str(make_model(tmp_path_factory.mktemp("ckpt") / "tiny", preset="tiny", seed=0))
