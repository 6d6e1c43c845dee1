"""The bench tests' fake OpenAI server (tests/testkit/fake_openai_server.py), one per test."""
from __future__ import annotations

import pytest

from testkit.fake_openai_server import running_fake_server


@pytest.fixture
def fake_server():
    with running_fake_server() as state:
        yield state
