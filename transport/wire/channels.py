"""Typed channels: the only way our code touches a ZeroMQ socket.

A `Sender` is a PUSH socket, a `Receiver` a PULL socket; both move whole
`Message`s (multipart, tensor frames sent and received with copy=False).
Each worker's inbox and the API's collector are Receivers that bind; everyone
else connects Senders to them (fan-in). `AsyncSender` / `AsyncReceiver` are the
same over `zmq.asyncio` for the API process.

`recv` returns a message, None on timeout, or raises `WireError` for bytes
that do not decode: the caller logs and keeps receiving, the socket is fine.
A receiving end may cap the size of one frame (`max_frame_bytes`, ZeroMQ's
MAXMSGSIZE): a peer that sends a larger one is disconnected before any of
it is kept (`transport/wire/frame_limits.py` says how large each end's frames
may legitimately be).

With `keys` (transport/wire/auth.py), tcp sockets are CURVE: a binding Receiver
admits only the plane's clients, and drops an `API_ONLY` message (Shutdown,
Abort, PrefillRequest, EncodeRequest, WorkerExited) that the API's key did
not send; Senders and Outboxes connect as CURVE clients. ipc sockets ignore
`keys` (their run directory is 0700).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Iterator

import zmq
import zmq.asyncio

from epd.transport.wire.auth import INBOX_DOMAIN, PlaneKeys, secure_client, secure_server
from epd.transport.wire.messages import (Abort, EncodeRequest, Message, PrefillRequest, Shutdown, WireError, WorkerExited,
                                   decode_message)

log = logging.getLogger("epd.transport")

# Messages, not bytes. A full queue blocks the sender (backpressure); 10k keeps
# bursts of small TokenOutputs from stalling a decode step while bounding memory.
DEFAULT_HWM = 10_000


def _open(ctx: zmq.Context, kind: int, address: str, bind: bool, hwm: int,
          keys: PlaneKeys | None = None, domain: str = INBOX_DOMAIN, server_key: bytes | None = None,
          max_frame_bytes: int | None = None) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, hwm)
    if max_frame_bytes is not None:  # a peer sending a larger frame is disconnected before it is kept
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    if keys is not None and address.startswith("tcp://"):
        if bind:
            secure_server(sock, keys, domain)
        else:
            secure_client(sock, keys, server_key or keys.worker_public)
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
    """PUSH end of a channel; connects by default. With `keys`, over tcp a CURVE
    client of `server_key` (default: a worker's)."""

    def __init__(self, address: str, *, bind: bool = False, hwm: int = DEFAULT_HWM,
                 ctx: zmq.Context | None = None, keys: PlaneKeys | None = None, server_key: bytes | None = None):
        self.address = address
        self.socket = _open(ctx or zmq.Context.instance(), zmq.PUSH, address, bind, hwm, keys,
                            server_key=server_key)

    def send(self, msg: Message) -> None:
        """Send one message; blocks while the queue is at its high-water mark.

        Tensor frames alias the tensors: do not modify them after sending.
        """
        self.socket.send_multipart(msg.to_wire(), copy=False)


# Messages only the API (or the launcher, over ipc) sends: over CURVE they count only
# with the API's key. A worker's key may say what a worker says (Ready, stats, outputs,
# EncodeDone, KVTransfer, KVAck), never start, stop or abort work, nor report an exit.
API_ONLY = (Shutdown, Abort, PrefillRequest, EncodeRequest, WorkerExited)


class _Admits:
    """What a receiving end accepts from whom: with CURVE, `API_ONLY` messages only from the API."""

    api_user_id: str | None = None

    def _check(self, msg: Message, frames: list) -> Message:
        if self.api_user_id is not None and isinstance(msg, API_ONLY) and _user_id(frames) != self.api_user_id:
            raise WireError(f"{msg.TYPE} from a peer that is not the API: ignored")
        return msg


def _user_id(frames: list) -> str | None:
    try:
        return frames[0].get("User-Id")
    except (zmq.ZMQError, AttributeError):  # no CURVE on this connection
        return None


class Receiver(_Channel, _Admits):
    """PULL end of a channel; binds by default. With `keys`, over tcp a CURVE
    server admitting `domain`'s clients."""

    def __init__(self, address: str, *, bind: bool = True, hwm: int = DEFAULT_HWM,
                 ctx: zmq.Context | None = None, keys: PlaneKeys | None = None, domain: str = INBOX_DOMAIN,
                 max_frame_bytes: int | None = None):
        self.socket = _open(ctx or zmq.Context.instance(), zmq.PULL, address, bind, hwm, keys, domain,
                            max_frame_bytes=max_frame_bytes)
        self.address = _endpoint(self.socket, address, bind)
        if keys is not None and address.startswith("tcp://"):
            self.api_user_id = keys.api_user_id

    def poll(self, timeout_s: float | None = None) -> bool:
        """True if a message is ready within `timeout_s` (None: wait forever)."""
        return bool(self.socket.poll(_ms(timeout_s), zmq.POLLIN))

    def recv(self, timeout_s: float | None = None) -> Message | None:
        """Next message, None after `timeout_s`; raises WireError for garbage."""
        if timeout_s is not None and not self.poll(timeout_s):
            return None
        frames = self.socket.recv_multipart(copy=False)
        return self._check(decode_message(frames), frames)

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
                 ctx: zmq.asyncio.Context | None = None, keys: PlaneKeys | None = None,
                 server_key: bytes | None = None):
        self.address = address
        self.socket = _open(ctx or zmq.asyncio.Context.instance(), zmq.PUSH, address, bind, hwm, keys,
                            server_key=server_key)

    async def send(self, msg: Message) -> None:
        """Send one message; waits while the queue is at its high-water mark."""
        await self.socket.send_multipart(msg.to_wire(), copy=False)


class AsyncReceiver(_Channel, _Admits):
    """asyncio PULL end of a channel; binds by default."""

    def __init__(self, address: str, *, bind: bool = True, hwm: int = DEFAULT_HWM,
                 ctx: zmq.asyncio.Context | None = None, keys: PlaneKeys | None = None,
                 domain: str = INBOX_DOMAIN, max_frame_bytes: int | None = None):
        self.socket = _open(ctx or zmq.asyncio.Context.instance(), zmq.PULL, address, bind, hwm, keys, domain,
                            max_frame_bytes=max_frame_bytes)
        self.address = _endpoint(self.socket, address, bind)
        self._sync: zmq.Socket | None = None
        if keys is not None and address.startswith("tcp://"):
            self.api_user_id = keys.api_user_id

    async def poll(self, timeout_s: float | None = None) -> bool:
        """True if a message is ready within `timeout_s` (None: wait forever)."""
        return bool(await self.socket.poll(_ms(timeout_s), zmq.POLLIN))

    async def recv(self, timeout_s: float | None = None) -> Message | None:
        """Next message, None after `timeout_s`; raises WireError for garbage."""
        if timeout_s is not None and not await self.poll(timeout_s):
            return None
        frames = await self.socket.recv_multipart(copy=False)
        return self._check(decode_message(frames), frames)

    def recv_nowait(self) -> Message | None:
        """The next message if one is here now, else None; raises WireError for
        garbage. A plain non-blocking read (no future, no event-loop round trip):
        a reader woken by `recv` takes the rest of a burst this way."""
        if self._sync is None:
            self._sync = zmq.Socket.shadow(self.socket.underlying)  # same socket, not owned
        try:
            frames = self._sync.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        return self._check(decode_message(frames), frames)


class Outbox:
    """Senders to many peers, connected on first use and kept: a worker
    replies to whatever address a message names (reply_to, decode worker).
    With `keys`, `api_address` (one, or a tuple: every API process's collector)
    names the peers holding the API's key."""

    def __init__(self, ctx: zmq.Context | None = None, keys: PlaneKeys | None = None,
                 api_address: str | tuple[str, ...] = ""):
        self._ctx = ctx
        self._keys = keys
        self._api_address = api_address
        self._senders: dict[str, Sender] = {}

    def send(self, address: str, msg: Message) -> None:
        sender = self._senders.get(address)
        if sender is None:
            server_key = self._keys.server_key(address, self._api_address) if self._keys else None
            sender = self._senders[address] = Sender(address, ctx=self._ctx, keys=self._keys, server_key=server_key)
        sender.send(msg)

    def close(self) -> None:
        for sender in self._senders.values():
            sender.close()
        self._senders.clear()


class AsyncOutbox:
    """`Outbox` for the asyncio API process (its peers are all workers)."""

    def __init__(self, ctx: zmq.asyncio.Context | None = None, keys: PlaneKeys | None = None):
        self._ctx = ctx
        self._keys = keys
        self._senders: dict[str, AsyncSender] = {}

    async def send(self, address: str, msg: Message) -> None:
        sender = self._senders.get(address)
        if sender is None:
            sender = self._senders[address] = AsyncSender(address, ctx=self._ctx, keys=self._keys)
        await sender.send(msg)

    def close(self) -> None:
        for sender in self._senders.values():
            sender.close()
        self._senders.clear()
