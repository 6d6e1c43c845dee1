"""epd/api/fast_path.py leans on the insides of FastAPI, Starlette and uvicorn: the
ranges it was written against are pinned in pyproject.toml, and these tests fail
when the pins, the module and the installed libraries drift apart, or when an
inside it relies on is gone or changed shape."""
from __future__ import annotations

import contextlib
import importlib.metadata
import inspect
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from epd.api import fast_path

PYPROJECT = next(p / "pyproject.toml" for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())


def _pinned() -> dict[str, SpecifierSet]:
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    return {(r := Requirement(line)).name.lower(): r.specifier for line in dependencies}


@pytest.mark.parametrize("name", sorted(fast_path.WRITTEN_AGAINST))
def test_pyproject_pins_the_range_the_fast_path_was_written_against(name):
    written = SpecifierSet(fast_path.WRITTEN_AGAINST[name])
    assert any(s.operator == "<" for s in written), f"{name}: no upper bound in WRITTEN_AGAINST"
    assert _pinned().get(name) == written, f"pyproject.toml's {name} range is not fast_path.WRITTEN_AGAINST's"


@pytest.mark.parametrize("name", sorted(fast_path.WRITTEN_AGAINST))
def test_the_installed_library_is_in_the_range(name):
    installed = importlib.metadata.version(name)
    assert SpecifierSet(fast_path.WRITTEN_AGAINST[name]).contains(installed, prereleases=True), (
        f"{name} {installed} is installed; epd/api/fast_path.py was written against "
        f"{fast_path.WRITTEN_AGAINST[name]}: read its docstring against the new version, then widen both ranges")


def _parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_uvicorns_httptools_protocol_has_the_hooks_the_fast_path_overrides():
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    assert _parameters(HttpToolsProtocol.connection_made) == ["self", "transport"]
    assert _parameters(HttpToolsProtocol.on_message_begin) == ["self"]
    assert _parameters(HttpToolsProtocol.on_headers_complete) == ["self"]
    assert _parameters(HttpToolsProtocol.connection_lost) == ["self", "exc"]
    init = inspect.getsource(HttpToolsProtocol.__init__)
    assert "self.loop =" in init  # the loop the header deadline and JoinedWrites use
    assert "self.transport = transport" in inspect.getsource(HttpToolsProtocol.connection_made)
    assert issubclass(fast_path.http_protocol(), HttpToolsProtocol)


def test_uvicorns_server_installs_signals_in_capture_signals():
    import uvicorn

    assert _parameters(uvicorn.Server.capture_signals) == ["self"]
    assert "capture_signals()" in inspect.getsource(uvicorn.Server.serve)
    server = uvicorn.Server(uvicorn.Config(app=None))
    assert (server.started, server.should_exit, server.force_exit) == (False, False, False)
    assert isinstance(fast_path.HttpServer(uvicorn.Config(app=None), None, 0.0).capture_signals(),
                      contextlib.AbstractContextManager)


def test_fastapi_is_called_as_an_asgi_app_and_parses_json_bodies_by_the_copied_rule():
    import fastapi.routing
    from fastapi import FastAPI

    assert _parameters(FastAPI.__call__) == ["self", "scope", "receive", "send"]
    source = inspect.getsource(fastapi.routing)
    # the content-type rule parse_json_body copies: email.message, "application", "json" or "+json"
    assert "email.message.Message()" in source and 'subtype.endswith("+json")' in source


def test_starlette_streams_event_streams_with_the_headers_the_fast_path_sends():
    import asyncio

    from starlette.responses import StreamingResponse

    async def body():
        yield b"data: x\n\n"

    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        await asyncio.sleep(10)

    asyncio.run(StreamingResponse(body(), media_type="text/event-stream")(
        {"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send))
    assert tuple(sent[0]["headers"]) == fast_path.SSE_HEADERS
