"""Every place the HTTP edge leans on the insides of FastAPI, Starlette or uvicorn.

The API's cost per token (docs/benchmarks_archive.md, "Serving overhead") was bought
by stepping around parts of the web stack; each such step is here, named,
with what it relies on, so that a library upgrade breaks one file that
says what to check. Everything else in epd/api uses the libraries' public
interfaces only (FastAPI routes, exception handlers, `lifespan=`, Starlette
responses as ASGI apps, `CORSMiddleware`, `uvicorn.Config`).

`WRITTEN_AGAINST` holds the version ranges this was written and tested
against; pyproject.toml pins the same ranges, and
tests/unit/api/test_fast_path.py fails when they differ from each other or from
what is installed, and when an inside relied on below is gone.

* `FastPathApp` (FastAPI subclass, `__call__`): a POST to a generation
  endpoint goes straight to EPD's plain-ASGI route, before FastAPI's
  middleware stack, routing and dependency solving. Relies on: `FastAPI.__call__`
  being the ASGI entry of every request.
* `parse_json_body` (FastAPI's body parsing, reproduced): the lean route must
  answer a body exactly as FastAPI's route would, so the rules of
  `fastapi.routing.get_request_handler` are copied: an empty body is a
  missing one, only a JSON content type (`application/json`,
  `application/*+json`, judged by `email.message.Message`) is decoded, the
  model validates the decoded value with `from_attributes=True`, errors get
  the `("body", ...)` location, anything else is "There was an error parsing
  the body". tests/unit/api/test_api_lean_route.py compares it with FastAPI's own route
  (`build_app(..., lean_routes=False)`).
* `SSE_HEADERS`: the headers Starlette's `StreamingResponse` sends for
  `media_type="text/event-stream"`.
* `http_protocol()` (subclass of uvicorn's internal
  `uvicorn.protocols.http.httptools_impl.HttpToolsProtocol`): `JoinedWrites`
  under the connection (one socket write per connection per event-loop
  pass) and a deadline on request headers. Relies on: the protocol's
  `connection_made(transport)`, `on_message_begin()`, `on_headers_complete()`,
  `connection_lost(exc)`, its `loop` and `transport` attributes, and that it
  writes only through `transport.write`.
* `HttpServer` (uvicorn.Server subclass, `capture_signals`): SIGTERM drains
  and SIGINT stops without uvicorn raising the signal again after the stop.
  Relies on: `Server.capture_signals()` being the context manager `serve()`
  installs signal handlers in, and the `started`, `should_exit`, `force_exit`
  attributes.
"""
from __future__ import annotations

import asyncio
import contextlib
import email.message
import functools
import json
import signal
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel, TypeAdapter, ValidationError

from epd.api.protocol import request_error_from_validation
from epd.requests import RequestError

# distribution -> the range this module was written and tested against (pyproject.toml pins the same)
# (the minor release tested; a newer one is read against the docstring above, then allowed here and there)
WRITTEN_AGAINST = {
    "fastapi": ">=0.165,<0.166",
    "starlette": ">=1.10,<1.11",
    "uvicorn": ">=0.54,<0.55",
}
HEADER_TIMEOUT_S = 30.0  # a request's headers must arrive within this (nginx's client_header_timeout is 60 s)
SSE_HEADERS = ((b"content-type", b"text/event-stream; charset=utf-8"),)  # what StreamingResponse sends


# -- FastAPI: the lean route taken first, bodies parsed by FastAPI's rules ----------------------------

class FastPathApp(FastAPI):
    """FastAPI, but an HTTP request that `takes(scope)` goes straight to `lean`
    (none of FastAPI's per-request machinery on the path every token takes)."""

    def __init__(self, lean, takes: Callable[[dict], bool], **kwargs):
        super().__init__(**kwargs)
        self._lean = lean
        self._takes = takes

    async def __call__(self, scope, receive, send) -> None:
        if self._lean is not None and scope["type"] == "http" and self._takes(scope):
            return await self._lean(scope, receive, send)
        await super().__call__(scope, receive, send)


async def read_body(receive) -> bytes | None:
    """The whole request body, or None when the client disconnected first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def header(scope, name: bytes) -> str | None:
    """The first header `name` (lower case, as ASGI servers pass names), like Starlette's Headers.get."""
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def parse_json_body(adapter: TypeAdapter, body: bytes, content_type: str | None) -> BaseModel:
    """FastAPI's handling of a JSON body parameter, step for step (module docstring)."""
    value: Any = body
    if not body:
        errors = [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
        raise request_error_from_validation(errors)
    if content_type is not None and _is_json(content_type):
        try:
            value = json.loads(body)
        except json.JSONDecodeError as exc:
            raise request_error_from_validation([{"type": "json_invalid", "loc": ("body", exc.pos),
                                                  "msg": "JSON decode error", "ctx": {"error": exc.msg}}]) from None
        except Exception:  # not UTF-8, nested too deep: FastAPI's own words
            raise RequestError("There was an error parsing the body") from None
    try:
        return adapter.validate_python(value, from_attributes=True)
    except ValidationError as exc:
        raise request_error_from_validation([{**e, "loc": ("body", *e["loc"])}
                                             for e in exc.errors(include_url=False)]) from None


@functools.lru_cache(maxsize=64)
def _is_json(content_type: str) -> bool:
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


# -- uvicorn: joined writes and a header deadline on the connection ---------------------------------

class JoinedWrites:
    """A transport whose writes in one pass of the event loop become one `write`;
    everything else is the wrapped transport's.

    uvicorn writes a response's status line and headers the moment the app
    sends `http.response.start`, and each body message on its own; a write
    that wakes a sleeping reader is among the dearest calls the API process
    makes. Held writes leave at the loop's next pass (`call_soon`): nothing
    waits on a timer. Closing writes what is held first."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._held:
            self._loop.call_soon(self._flush)
        self._held.append(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def _flush(self) -> None:
        held, self._held = self._held, []
        if held and not self._transport.is_closing():
            self._transport.write(held[0] if len(held) == 1 else b"".join(held))

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


def http_protocol(header_timeout_s: float = HEADER_TIMEOUT_S) -> type[asyncio.Protocol] | str:
    """uvicorn's `http` setting: httptools' protocol with joined writes and a
    deadline on request headers, or "auto" (uvicorn's own choice) where
    httptools is not installed.

    uvicorn closes a connection idle between requests but gives a request's
    headers all the time a client takes; here a connection whose request
    headers are not complete `header_timeout_s` after it opened, or after the
    request's first byte, is closed."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "auto"

    class EpdHttpProtocol(HttpToolsProtocol):
        _header_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(JoinedWrites(transport, self.loop))
            self._expect_headers()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._expect_headers()

        def on_headers_complete(self) -> None:
            self._headers_arrived()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._headers_arrived()
            super().connection_lost(exc)

        def _expect_headers(self) -> None:
            self._headers_arrived()
            self._header_deadline = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _headers_arrived(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def _headers_too_slow(self) -> None:
            self._header_deadline = None
            if not self.transport.is_closing():
                self.transport.close()

    return EpdHttpProtocol


# -- uvicorn: EPD's signals -------------------------------------------------------------------------

class HttpServer(uvicorn.Server):
    """uvicorn with EPD's signals. SIGTERM drains: `drain(grace_s)` refuses new
    requests and lets those in flight finish for `--shutdown-grace`, then ends
    the rest with an OpenAI error; Ctrl-C does the same with no grace. Only
    then does uvicorn stop (open connections get 3 s), so it never has a
    request left to cut off. A second Ctrl-C stops at once; a second SIGTERM
    changes nothing (one came to the whole group). Neither signal is
    raised again after the stop (uvicorn's own habit, which for SIGTERM killed
    the process before the launcher could clean up)."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[float], Awaitable[None]], grace_s: float):
        super().__init__(config)
        self._drain = drain
        self._grace_s = grace_s
        self._draining: asyncio.Task | None = None

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        loop = asyncio.get_running_loop()
        originals = {sig: signal.signal(sig, lambda sig, _frame: loop.call_soon_threadsafe(self._on_signal, sig))
                     for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int) -> None:
        if self.started and self._draining is None:
            grace_s = self._grace_s if sig == signal.SIGTERM else 0.0
            self._draining = asyncio.get_running_loop().create_task(self._drain_then_exit(grace_s))
        elif sig == signal.SIGTERM and self._draining is not None:
            pass  # the group's SIGTERM and the launcher's (--api-servers N): one drain
        elif self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True

    async def _drain_then_exit(self, grace_s: float) -> None:
        try:
            await self._drain(grace_s)
        finally:
            self.should_exit = True
