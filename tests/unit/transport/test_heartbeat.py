"""A worker's heartbeat thread over real CURVE tcp sockets: while its loop is
busy (sends no WorkerStats) it says Alive to every API collector; once the loop
publishes again it stays quiet; closing the worker stops it."""
from __future__ import annotations

import time

import zmq
from epd.transport.wire.auth import API, COLLECTOR_DOMAIN, PlaneKeys, make_keys
from epd.transport.wire.channels import Receiver
from epd.transport.wire.messages import Alive, Ready, WorkerStats
from epd.transport.wire.worker_io import HEARTBEAT_INTERVAL_S, WorkerIO, WorkerSpec

WAIT_S = 30.0
# The collectors' own context: a context's ZAP handler admits the keys it first saw (other
# tests' keys in the process-wide one). Kept for the process: it ends with its ZAP handler.
CTX = zmq.Context()


def _stats() -> WorkerStats:
    return WorkerStats("encoder-0", "encoder", num_running=0, num_waiting=0, num_free_blocks=0,
                       num_total_blocks=0, queue_depth=0)


def _next(collector: Receiver, kind: type) -> object:
    """The next message of `kind` (skipping others), within WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        msg = collector.recv(timeout_s=max(0.0, deadline - time.monotonic()))
        if isinstance(msg, kind):
            return msg
    raise AssertionError(f"no {kind.__name__} within {WAIT_S} s")


def test_a_busy_worker_says_alive_to_every_api_and_stops_when_closed(tmp_path):
    keys_dir = make_keys(tmp_path / "keys")
    api = PlaneKeys.load(keys_dir, API)
    collectors = [Receiver("tcp://127.0.0.1:*", keys=api, domain=COLLECTOR_DOMAIN, ctx=CTX) for _ in range(2)]
    spec = WorkerSpec("encoder-0", "encoder", "tcp://127.0.0.1:*", tuple(c.address for c in collectors),
                      mm_cache_dir=None, mm_cache_bytes=0, keys_dir=str(keys_dir))
    worker = WorkerIO(spec, model_fingerprint="x")
    try:
        worker.announce()  # starts the heartbeat; then the "loop" publishes nothing (a long batch)
        for collector in collectors:
            assert isinstance(_next(collector, Ready), Ready)
            beats = [_next(collector, Alive) for _ in range(3)]
            assert {b.worker_id for b in beats} == {"encoder-0"}
            busy = [b.busy_s for b in beats]
            assert busy == sorted(busy) and busy[0] >= HEARTBEAT_INTERVAL_S  # one busy stretch, growing
        longest_s = busy[-1]
        worker.publish(_stats())  # the loop came back: later beats count from here
        while (beat := _next(collectors[0], Alive)).busy_s >= longest_s:  # beats sent before it, still queued
            longest_s = beat.busy_s
    finally:
        worker.close()
    assert not worker.heartbeat._thread.is_alive()
    for collector in collectors:
        collector.close()
