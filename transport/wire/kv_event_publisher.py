"""KVEventPublisher: an engine worker's KV events on a ZeroMQ PUB socket, as
vLLM's `ZmqEventPublisher` sends them, with its replay socket.

Each batch goes out as three frames `(topic, seq, payload)`: the topic's
UTF-8 bytes, an 8-byte big-endian sequence number counting batches from 0,
and the msgpack `EventBatch` (transport/wire/kv_events.py). A subscriber that
sees a gap in the numbers asks the replay socket (a ROUTER) for the batches
from `seq` on: it sends `(b"", seq as 8 bytes big-endian)` from a DEALER
socket and gets one `(b"", topic, seq, payload)` per batch still in the last
`buffer_steps`, then `(b"", b"", -1 as 8 signed bytes, b"")`.

Batches are sent from the worker's own thread after its step (a PUB socket
never blocks: past `hwm` queued messages it drops them, as vLLM's does);
replay requests are answered between steps (`serve_replays`).
"""
from __future__ import annotations

import time
from collections import deque

import zmq

from epd.transport.wire.kv_events import KVCacheEvent, KVEventsConfig, encode_event_batch

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last reply


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard or ipc/inproc address, connect to any other."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """One engine worker's publisher: `publish(events)` per step, `serve_replays()` between steps."""

    def __init__(self, config: KVEventsConfig, ctx: zmq.Context | None = None) -> None:
        self.config = config
        self._ctx = ctx or zmq.Context.instance()
        self._topic = config.topic.encode("utf-8")
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(config.hwm)
        if is_bind_endpoint(config.endpoint):
            self._pub.bind(config.endpoint)
        else:
            self._pub.connect(config.endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or config.endpoint  # tcp://*:0's port
        self._replay = None
        self.replay_endpoint = None
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(config.replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will carry (batches sent so far)."""
        return self._next_seq

    def publish(self, events: list[KVCacheEvent]) -> None:
        """One batch of a step's events (none: nothing is sent)."""
        if not events:
            return
        seq, payload = self._next_seq, encode_event_batch(time.time(), events)
        self._next_seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))

    def serve_replays(self) -> int:
        """Answers every replay request waiting; returns how many."""
        num_served = 0
        while self._replay is not None and self._replay.poll(0):
            frames = self._replay.recv_multipart()
            num_served += 1
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # not a replay request: nothing to answer (vLLM's logs it)
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in self._buffer:
                if seq >= start_seq:
                    self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
        return num_served

    def close(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
