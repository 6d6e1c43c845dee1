"""`JoinedWrites`: a connection's writes in one event-loop pass leave as one write, in order,
and closing writes what is held first (a real socket pair, a real asyncio transport)."""
from __future__ import annotations

import asyncio
import socket

from epd.api.http_protocol import JoinedWrites


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
