"""uvicorn's HTTP protocol with one write per connection per event-loop pass and a
deadline on request headers: `http_protocol()`.

uvicorn writes a response's status line and headers to the socket the moment
the app sends `http.response.start`, and each body message on its own, so a
one-token answer costs two socket writes, and the headers of a stream one
more than its chunks. A write that wakes a sleeping reader is among the
dearest calls the API process makes (docs/benchmarks.md, "The per-request
cost"). Here a connection's writes are held until the event loop's next pass
(`call_soon`) and leave as one: the headers go with the first body chunk,
and the end of a body with its last chunk. Nothing waits on a timer; a write
is late by at most one pass of the loop. Closing the connection writes what
is held first.
"""
from __future__ import annotations

import asyncio

HEADER_TIMEOUT_S = 30.0  # a request's headers must arrive within this (nginx's client_header_timeout is 60 s)


class JoinedWrites:
    """A transport whose writes in one pass of the event loop become one `write`;
    everything else is the wrapped transport's."""

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

    uvicorn closes a connection idle between requests (its keep-alive
    timeout) but gives a request's headers all the time a client takes: one
    that opens connections and sends a byte now and then holds them open for
    ever. Here a connection whose request headers are not complete
    `header_timeout_s` after it opened, or after the request's first byte,
    is closed."""
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
