"""`JoinedWrites` (epd/api/fast_path.py): a connection's writes in one event-loop pass
leave as one write, in order, and closing writes what is held first (a real socket pair, a real asyncio transport)."""
from __future__ import annotations

import asyncio
import socket

from epd.api.fast_path import JoinedWrites


class _CountingTransport:
    """The real transport, with its writes counted."""

    def __init__(self, transport):
        self.transport, self.num_writes = transport, 0

    def write(self, data):
        self.num_writes += 1
        self.transport.write(data)

    def __getattr__(self, name):
        return getattr(self.transport, name)


async def _transport_pair():
    ours, theirs = socket.socketpair()
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, ours)
    theirs.setblocking(False)
    return _CountingTransport(transport), theirs, loop


async def _read_until_eof(sock, loop) -> bytes:
    data = b""
    while chunk := await asyncio.wait_for(loop.sock_recv(sock, 4096), 5):
        data += chunk
    return data


def test_writes_of_one_pass_are_one_write_and_close_flushes():
    async def run():
        counting, theirs, loop = await _transport_pair()
        joined = JoinedWrites(counting, loop)
        joined.write(b"HTTP/1.1 200 OK\r\n\r\n")  # the headers
        joined.write(b"5\r\nhello\r\n")  # and the body, in the same pass
        assert counting.num_writes == 0
        await asyncio.sleep(0)  # one pass
        assert counting.num_writes == 1
        joined.write(b"0\r\n\r\n")
        joined.close()  # held: written before the close
        assert counting.num_writes == 2 and joined.is_closing()  # other attributes are the transport's
        assert await _read_until_eof(theirs, loop) == b"HTTP/1.1 200 OK\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
        theirs.close()

    asyncio.run(run())


def test_a_connection_whose_headers_dawdle_is_closed_and_a_prompt_one_is_served():
    """A real uvicorn with EPD's protocol and a 0.5 s header deadline: a client that
    sends half its headers and waits is cut off; one that sends them all is answered."""
    import threading
    import time

    import uvicorn

    from epd.api.fast_path import http_protocol

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off",
                                           http=http_protocol(header_timeout_s=0.5)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    address = sock.getsockname()
    try:
        with socket.create_connection(address, timeout=10) as slow:
            slow.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n")  # and never the blank line
            assert slow.recv(100) == b""  # closed by the server, within the 10 s socket timeout
        with socket.create_connection(address, timeout=10) as idle:  # a connection that says nothing
            assert idle.recv(100) == b""
        with socket.create_connection(address, timeout=10) as prompt:
            prompt.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            time.sleep(1.0)  # past the deadline: it was met, nothing is cut
            assert prompt.recv(1000).endswith(b"ok")
    finally:
        server.should_exit = True
        thread.join(timeout=5)
