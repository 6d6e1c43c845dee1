"""What a peer holding the worker-plane keys can and cannot do to the API
(issue 33, items 2-4; docs/architecture.md, "The worker plane's authority").

A real `Orchestrator` with its collector on tcp + CURVE (the tiny
checkpoint's tokenizer); the test plays one real aggregated worker and a
forger, both with the worker keys, over real ZeroMQ sockets. A PUSH socket's
messages arrive in order, so each forgery is followed, on the forger's own
socket, by a harmless Ready for a new worker id: once that one is
registered, the forgery before it has been read (and dropped or refused).
"""
from __future__ import annotations

import asyncio
import socket
import time


from epd.api.protocol import GenerateRequest
from epd.config import ServeConfig
from epd.serve.orchestrator import Orchestrator
from epd.serve.registry import WorkerInfo
from epd.transport.wire.auth import WORKER, PlaneKeys, make_keys
from epd.transport.wire.channels import Receiver, Sender
from epd.transport.wire.messages import PrefillRequest, Ready, TokenOutput, WorkerExited, WorkerStats
from epd.transport.wire.sampling import SamplingParams

SESSION, FORGED = "1" * 32, "f" * 32


async def _until(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


class _Plane:
    """The orchestrator, its one real worker and a forger, all keyed."""

    def __init__(self, tiny_model: str, tmp_path):
        keys_dir = make_keys(tmp_path / "keys")
        self.worker_keys = PlaneKeys.load(keys_dir, WORKER)
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        self.collector = f"tcp://127.0.0.1:{port}"
        self.orch = Orchestrator(ServeConfig(model=tiny_model, mode="aggregated"), self.collector,
                                 str(tmp_path / "cache"), keys_dir=str(keys_dir))
        self.inbox = Receiver("tcp://127.0.0.1:*", keys=self.worker_keys)
        self.worker = self._sender()
        self.forger = self._sender()
        self._markers = 0

    def _sender(self) -> Sender:
        keys = self.worker_keys
        return Sender(self.collector, keys=keys, server_key=keys.api_public)

    async def start(self) -> None:
        await self.orch.start()
        self.worker.send(Ready("aggregated-0", "aggregated", self.inbox.address, "hosta", None, SESSION))
        await self.orch.wait_for_workers(1, timeout_s=20)

    async def forge(self, msg) -> None:
        """`msg` from the forger, then a marker: returns once both were read."""
        self._markers += 1
        marker = f"encoder-{40 + self._markers}"
        self.forger.send(msg)
        self.forger.send(Ready(marker, "encoder", f"tcp://127.0.0.1:{7000 + self._markers}", "h", None, FORGED))
        await _until(lambda: marker in self.orch.registry.workers)

    @property
    def real(self) -> WorkerInfo:
        return self.orch.registry.workers["aggregated-0"]

    async def close(self) -> None:
        await self.orch.stop()
        for channel in (self.inbox, self.worker, self.forger):
            channel.close()


def _run(tiny_model, tmp_path, body) -> None:
    async def main():
        plane = _Plane(tiny_model, tmp_path)
        try:
            await plane.start()
            await body(plane)
        finally:
            await plane.close()
    asyncio.run(main())


def test_a_forged_exit_does_not_remove_a_live_worker(tiny_model, tmp_path):
    async def body(plane):
        await plane.forge(WorkerExited("aggregated-0", 9))
        assert plane.orch.registry.live("aggregated") == [plane.real]
        assert plane.orch.missing_roles() == []
    _run(tiny_model, tmp_path, body)


def test_a_forged_ready_does_not_take_over_a_live_worker_and_requests_still_reach_it(tiny_model, tmp_path):
    async def body(plane):
        rogue = Receiver("tcp://127.0.0.1:*", keys=plane.worker_keys)
        try:
            await plane.forge(Ready("aggregated-0", "aggregated", rogue.address, "evil", None, FORGED))
            assert plane.real.inbox == plane.inbox.address and plane.real.session == SESSION
            stream = plane.orch.generate(GenerateRequest("cmpl-1", None, [400, 401], SamplingParams(max_tokens=1)))
            first = asyncio.ensure_future(anext(stream))
            await _until(lambda: plane.inbox.poll(0))
            assert isinstance(plane.inbox.recv(), PrefillRequest)  # the prompt went to the real worker
            assert not rogue.poll(0.2)
            plane.worker.send(TokenOutput("cmpl-1", [300], finished=True, finish_reason="length",
                                          num_prompt_tokens=2))
            assert (await first).finish_reason == "length"
            await stream.aclose()
        finally:
            rogue.close()
    _run(tiny_model, tmp_path, body)


def test_forged_stats_neither_mislead_the_router_nor_keep_a_worker_alive(tiny_model, tmp_path):
    async def body(plane):
        plane.worker.send(WorkerStats("aggregated-0", "aggregated", 1, 0, 8, 8, 0, session=SESSION))
        await _until(lambda: plane.real.stats is not None)
        await plane.forge(WorkerStats("aggregated-0", "aggregated", 999, 999, 0, 8, 999, session=FORGED))
        assert plane.real.load == 1
    _run(tiny_model, tmp_path, body)


def test_a_garbled_ready_is_dropped_and_the_collector_reads_on(tiny_model, tmp_path):
    async def body(plane):
        frames = Ready("decode-9", "decode", "tcp://127.0.0.1:7999", "h", None, FORGED).to_wire()
        header = bytes(frames[0]).replace(b"tcp://127.0.0.1:7999", b"tcp://127.0.0.1:79;9")  # one byte off
        plane.forger.socket.send_multipart([header])
        await plane.forge(WorkerStats("encoder-0", "encoder", 0, 0, 0, 0, 0))
        assert "decode-9" not in plane.orch.registry.workers
    _run(tiny_model, tmp_path, body)


def test_the_collector_survives_a_worker_it_cannot_send_to(tiny_model, tmp_path):
    """The probe's case: a late output of an abandoned try makes the API abort it
    everywhere, and one worker's address cannot be connected to (registered before
    addresses were checked; here put in the registry directly). The abort fails for
    that worker alone; the collector reads on."""
    async def body(plane):
        plane.orch.registry.workers["decode-7"] = WorkerInfo("decode-7", "decode", "tcp://no such host:1")
        plane.orch.collector._abandoned["cmpl-gone"] = None
        plane.worker.send(TokenOutput("cmpl-gone", [5], num_prompt_tokens=1))
        await plane.forge(Ready("encoder-9", "encoder", "tcp://127.0.0.1:7009", "h", None, FORGED))
        assert "cmpl-gone" not in plane.orch.collector._abandoned  # it was handled, and the next message too
    _run(tiny_model, tmp_path, body)
