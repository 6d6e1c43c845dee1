"""The request body's size cap (`--max-request-body-mb`): `call_within_limit`.

A body is refused with a 413 before its cost is paid: at once when its
Content-Length says it is too large, otherwise as soon as the bytes read
pass the cap (a chunked body has no length). Nothing past the cap is kept:
the app sees the request end (an `http.disconnect`), what it answers or
raises then is dropped, and the 413 goes out instead. Before answering, the rest of the body is read and thrown away
(at most `DRAIN_S` seconds), so the client, still sending, is not reset
mid-write and reads the 413; a client that asked `Expect: 100-continue`
sent no body and gets the 413 at once. The connection is closed after.
"""
from __future__ import annotations

import asyncio
import time

from epd.api.errors import error_response
from epd.requests import RequestError

DRAIN_S = 10.0  # longest a refused body is read (and thrown away) before the 413 goes out


async def call_within_limit(app, scope, receive, send, max_bytes: int) -> None:
    """Runs the ASGI `app` on one request whose body may hold at most `max_bytes`."""
    declared = declared_length(scope)
    if declared is not None and declared > max_bytes:  # refused unread
        return await refuse_body(receive, send, scope, max_bytes, drain=not expects_continue(scope))
    body = BodyLimit(receive, max_bytes)
    started = False

    async def send_unless_refused(message) -> None:
        nonlocal started
        if body.exceeded and not started:
            return  # the app's answer to a "disconnect" that was the cap
        started = started or message["type"] == "http.response.start"
        await send(message)

    try:
        await app(scope, body, send_unless_refused)
    except Exception:
        if not body.exceeded:
            raise
    if body.exceeded and not started:
        await refuse_body(receive, send, scope, max_bytes, drain=body.more_body)


def declared_length(scope) -> int | None:
    """The request's Content-Length, None when absent or not a number (the server refuses those)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def expects_continue(scope) -> bool:
    return any(name == b"expect" and value.lower() == b"100-continue" for name, value in scope["headers"])


class BodyLimit:
    """A `receive` that counts body bytes; past `max_bytes` it keeps nothing more
    and tells the app the client left (`exceeded` says why)."""

    def __init__(self, receive, max_bytes: int):
        self._receive = receive
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.exceeded = False
        self.more_body = True  # whether the client is still sending (read the rest before answering)

    async def __call__(self) -> dict:
        if self.exceeded:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.request":
            self.num_bytes += len(message.get("body", b""))
            self.more_body = message.get("more_body", False)
            if self.num_bytes > self.max_bytes:
                self.exceeded = True
                return {"type": "http.disconnect"}
        return message


def too_large(max_bytes: int) -> RequestError:
    return RequestError(f"the request body is larger than {max_bytes} bytes (--max-request-body-mb "
                        f"{max_bytes / (1 << 20):g}); send large images by URL", status=413,
                        code="request_too_large")


async def refuse_body(receive, send, scope, max_bytes: int, *, drain: bool) -> None:
    """The 413; `drain`: the client is still sending its body, read the rest first (bounded in time)."""
    if drain:
        await _discard_rest(receive)
    await error_response(too_large(max_bytes), headers={"connection": "close"})(scope, receive, send)


async def _discard_rest(receive) -> None:
    deadline = time.monotonic() + DRAIN_S
    while (left := deadline - time.monotonic()) > 0:
        try:
            message = await asyncio.wait_for(receive(), left)
        except asyncio.TimeoutError:
            return
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
