"""The HTTP edge's tests: one app in front of a `FakeOrchestrator` per test module
(tests/testkit/fake_api.py)."""
from __future__ import annotations

import openai
import pytest
from testkit.fake_api import API_KEY, FakeOrchestrator, serve_app


@pytest.fixture(scope="module")
def server():
    yield from serve_app(FakeOrchestrator())


@pytest.fixture
def base_url(server):
    return server[0]


@pytest.fixture
def fake(server):
    server[1].healthy = True
    return server[1]


@pytest.fixture
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0)
