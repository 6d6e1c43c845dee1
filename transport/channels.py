"""Typed channels: the only way our code touches a ZeroMQ socket.

A `Sender` is a PUSH socket, a `Receiver` a PULL socket; both move whole
`Message`s (multipart, tensor frames sent and received with copy=False).
Each worker's inbox and the API's collector are Receivers that bind; everyone
else connects Senders to them (fan-in). `AsyncSender` / `AsyncReceiver` are the
same over `zmq.asyncio` for the API process.

`recv` returns a message, None on timeout, or raises `WireError` for bytes
that do not decode: the caller logs and keeps receiving, the socket is fine.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Iterator

import zmq
import zmq.asyncio

from epd.transport.messages import Message, WireError, decode_message

log = logging.getLogger("epd.transport")

# Messages, not bytes. A full queue blocks the sender (backpressure); 10k keeps
# bursts of small TokenOutputs from stalling a decode step while bounding memory.
DEFAULT_HWM = 10_000


def _open(ctx: zmq.Context, kind: int, address: str, bind: bool, hwm: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, hwm)
    try:
        if bind:
            if address.startswith("ipc://"):
                os.makedirs(os.path.dirname(address[len("ipc://"):]) or ".", exist_ok=True)
            sock.bind(address)
        else:
            sock.connect(address)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        raise zmq.ZMQError(e.errno, f"{'bind' if bind else 'connect'} {address}: {e}") from e
    return sock


def _endpoint(sock: zmq.Socket, address: str, bind: bool) -> str:
    """The address actually bound (resolves "tcp://127.0.0.1:*" to a port)."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT) if bind else address


def _ms(timeout_s: float | None) -> int | None:
    return None if timeout_s is None else max(0, int(timeout_s * 1000))


class _Channel:
    socket: Any
    address: str

    def close(self, linger_s: float = 0.0) -> None:
        """Close the socket; unsent messages are dropped after `linger_s`."""
        self.socket.close(linger=int(linger_s * 1000))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Sender(_Channel):
    """PUSH end of a channel; connects by default."""

    def __init__(self, address: str, *, bind: bool = False, hwm: int = DEFAULT_HWM,
                 ctx: zmq.Context | None = None):
        self.address = address
        self.socket = _open(ctx or zmq.Context.instance(), zmq.PUSH, address, bind, hwm)

    def send(self, msg: Message) -> None:
        """Send one message; blocks while the queue is at its high-water mark.

        Tensor frames alias the tensors: do not modify them after sending.
        """
        self.socket.send_multipart(msg.to_wire(), copy=False)


class Receiver(_Channel):
    """PULL end of a channel; binds by default."""

    def __init__(self, address: str, *, bind: bool = True, hwm: int = DEFAULT_HWM,
                 ctx: zmq.Context | None = None):
        self.socket = _open(ctx or zmq.Context.instance(), zmq.PULL, address, bind, hwm)
        self.address = _endpoint(self.socket, address, bind)

    def poll(self, timeout_s: float | None = None) -> bool:
        """True if a message is ready within `timeout_s` (None: wait forever)."""
        return bool(self.socket.poll(_ms(timeout_s), zmq.POLLIN))

    def recv(self, timeout_s: float | None = None) -> Message | None:
        """Next message, None after `timeout_s`; raises WireError for garbage."""
        if timeout_s is not None and not self.poll(timeout_s):
            return None
        return decode_message(self.socket.recv_multipart(copy=False))

    def drain(self, timeout_s: float, name: str = "") -> Iterator[Message]:
        """Every message ready now, waiting up to `timeout_s` for the first.
        Garbage is logged and skipped: a worker loop keeps serving."""
        while True:
            try:
                msg = self.recv(timeout_s)
            except WireError as exc:
                log.warning("%s: dropped a malformed message: %s", name or self.address, exc)
                continue
            if msg is None:
                return
            timeout_s = 0.0
            yield msg


class AsyncSender(_Channel):
    """asyncio PUSH end of a channel; connects by default."""

    def __init__(self, address: str, *, bind: bool = False, hwm: int = DEFAULT_HWM,
                 ctx: zmq.asyncio.Context | None = None):
        self.address = address
        self.socket = _open(ctx or zmq.asyncio.Context.instance(), zmq.PUSH, address, bind, hwm)

    async def send(self, msg: Message) -> None:
        """Send one message; waits while the queue is at its high-water mark."""
        await self.socket.send_multipart(msg.to_wire(), copy=False)


class AsyncReceiver(_Channel):
    """asyncio PULL end of a channel; binds by default."""

    def __init__(self, address: str, *, bind: bool = True, hwm: int = DEFAULT_HWM,
                 ctx: zmq.asyncio.Context | None = None):
        self.socket = _open(ctx or zmq.asyncio.Context.instance(), zmq.PULL, address, bind, hwm)
        self.address = _endpoint(self.socket, address, bind)

    async def poll(self, timeout_s: float | None = None) -> bool:
        """True if a message is ready within `timeout_s` (None: wait forever)."""
        return bool(await self.socket.poll(_ms(timeout_s), zmq.POLLIN))

    async def recv(self, timeout_s: float | None = None) -> Message | None:
        """Next message, None after `timeout_s`; raises WireError for garbage."""
        if timeout_s is not None and not await self.poll(timeout_s):
            return None
        return decode_message(await self.socket.recv_multipart(copy=False))


class Outbox:
    """Senders to many peers, connected on first use and kept: a worker
    replies to whatever address a message names (reply_to, decode worker)."""

    def __init__(self, ctx: zmq.Context | None = None):
        self._ctx = ctx
        self._senders: dict[str, Sender] = {}

    def send(self, address: str, msg: Message) -> None:
        sender = self._senders.get(address)
        if sender is None:
            sender = self._senders[address] = Sender(address, ctx=self._ctx)
        sender.send(msg)

    def close(self) -> None:
        for sender in self._senders.values():
            sender.close()
        self._senders.clear()


class AsyncOutbox:
    """`Outbox` for the asyncio API process."""

    def __init__(self, ctx: zmq.asyncio.Context | None = None):
        self._ctx = ctx
        self._senders: dict[str, AsyncSender] = {}

    async def send(self, address: str, msg: Message) -> None:
        sender = self._senders.get(address)
        if sender is None:
            sender = self._senders[address] = AsyncSender(address, ctx=self._ctx)
        await sender.send(msg)

    def close(self) -> None:
        for sender in self._senders.values():
            sender.close()
        self._senders.clear()
