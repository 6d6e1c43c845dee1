"""An engine worker's per-request state (engine/worker/loop.py `_RequestState`):
one record per request, made on its arrival and gone, with everything in it,
once the request leaves the worker (its last output, its KVAck, an abort, a
failure). Over real ZeroMQ sockets, with a fake engine behind the worker."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from epd.engine.early_prefill import EarlyPrefill
from epd.engine.engine_core import StepResult
from epd.engine.request import Request
from epd.engine.worker.loop import EngineWorker
from epd.transport.wire.addresses import Addresses
from epd.transport.wire.channels import Receiver
from epd.transport.wire.messages import Abort, KVAck, KVTransfer, PrefillRequest, TokenOutput
from epd.transport.wire.sampling import SamplingParams
from epd.transport.wire.worker_io import WorkerSpec


class FakeCore:
    """The EngineCore verbs the worker calls outside a step; the engine's own
    state is not what these tests look at."""

    def __init__(self):
        self.info = SimpleNamespace(fingerprint="f", num_layers=1, num_kv_heads=1, head_dim=4, hidden_size=8,
                                    max_model_len=64)
        self.config = SimpleNamespace(early_prefill=True, kv_events_config=None, resolved_max_model_len=lambda n: n,
                                      scheduler=SimpleNamespace(block_size=4))
        self.early_prefill = EarlyPrefill()
        self.room = True  # add_prefilled: whether blocks are free
        self.added, self.aborted, self.released = [], [], []
        self.result = StepResult()  # what the next step returns

    def add_request(self, request, embeddings=None, pending=frozenset()):
        self.added.append(request.request_id)

    def add_prefilled(self, request, k_blocks, v_blocks, draft_state=None, state=None) -> bool:
        if self.room:
            self.added.append(request.request_id)
        return self.room

    def export_kv(self, request_id):
        return torch.zeros(1, 1, 4, 1, 4), torch.zeros(1, 1, 4, 1, 4)

    def export_draft_state(self, request_id):
        return None  # no EAGLE-3 head

    def export_state(self, request_id):
        return {}  # a model with KV only

    def release(self, request_id) -> bool:
        self.released.append(request_id)
        return True

    def abort(self, request_ids) -> list[str]:
        self.aborted += list(request_ids)
        return [rid for rid in request_ids if rid in self.added]

    def get_embedding(self, mm_hash):
        return None

    def has_unfinished(self) -> bool:
        return False

    def step(self) -> StepResult:
        return self.result


@pytest.fixture
def plane(tmp_path):
    addresses = Addresses.ipc(tmp_path)
    collectors = [Receiver(addresses.collector(k)) for k in range(2)]
    decode = Receiver(addresses.worker("decode", 0))
    made = []

    def make(role: str) -> EngineWorker:
        spec = WorkerSpec(f"{role}-0", role, addresses.worker(role, 1), tuple(c.address for c in collectors),
                          None, 0)
        worker = EngineWorker(spec, FakeCore())
        worker.heartbeat.interval_s = 3600.0
        made.append(worker)
        return worker

    yield SimpleNamespace(make=make, collectors=collectors, decode=decode)
    for worker in made:
        worker.close()
    for socket in [*collectors, decode]:
        socket.close()


def prefill_request(request_id: str, decode_worker: str | None = None, api_index: int = 0) -> PrefillRequest:
    return PrefillRequest(request_id, [1, 2, 3], [], SamplingParams(max_tokens=4), [0], decode_worker, api_index)


def kv_transfer(request_id: str, reply_to: str, api_index: int = 0) -> KVTransfer:
    return KVTransfer(request_id, [1, 2, 3], 5, SamplingParams(max_tokens=4), [0], [],
                      torch.zeros(1, 1, 4, 1, 4), torch.zeros(1, 1, 4, 1, 4), reply_to=reply_to, api_index=api_index)


def test_a_failure_after_the_kv_left_forgets_the_request_whole(plane):
    """`_fail` used to leave the KV transfer's start time behind."""
    worker = plane.make("prefill")
    worker._handle(prefill_request("r", decode_worker=plane.decode.address, api_index=1))
    state = worker.requests["r"]
    assert (state.api_index, state.decode_target) == (1, plane.decode.address)
    worker._send_kv(Request("r", [1, 2, 3], SamplingParams(max_tokens=4), eos_token_ids=(0,), output_token_ids=[5]))
    assert state.decode_target is None and state.transfer_start_s is not None
    assert isinstance(plane.decode.recv(timeout_s=5), KVTransfer)

    worker._fail("r", "boom")
    assert worker.requests == {}
    out = plane.collectors[1].recv(timeout_s=5)  # answered at the request's own API process
    assert isinstance(out, TokenOutput) and (out.request_id, out.finish_reason, out.error) == ("r", "error", "boom")


def test_a_kv_ack_forgets_the_request_and_counts_the_transfer(plane):
    worker = plane.make("prefill")
    worker._handle(prefill_request("r", decode_worker=plane.decode.address))
    worker._send_kv(Request("r", [1, 2, 3], SamplingParams(max_tokens=4), eos_token_ids=(0,), output_token_ids=[5]))
    worker._handle(KVAck("r", ok=True))
    assert worker.requests == {} and worker.core.released == ["r"]
    assert worker.counters.num_kv_transfers == 1


def test_kv_waiting_for_blocks_is_counted_admitted_in_order_and_aborted(plane):
    worker = plane.make("decode")
    worker.core.room = False
    for rid in ("a", "b", "c"):
        worker._handle(kv_transfer(rid, plane.decode.address, api_index=1))  # stands in for the prefill worker
    worker._admit_transfers()
    assert worker._num_incoming == 3 and worker.core.added == []

    worker._handle(Abort(["b"]))
    assert "b" not in worker.requests and worker._num_incoming == 2
    assert worker.counters.num_aborted == 1  # its KV was never taken

    worker.core.room = True
    worker._admit_transfers()
    assert worker.core.added == ["a", "c"] and worker._num_incoming == 0
    assert all(worker.requests[rid].transfer is None for rid in ("a", "c"))
    assert worker.counters.kv_transfer_bytes > 0
    assert [plane.decode.recv(timeout_s=5).request_id for _ in range(2)] == ["a", "c"]  # the KVAcks


def test_abort_by_api_process_takes_only_that_process_requests(plane):
    worker = plane.make("pd")
    worker._handle(prefill_request("zero", api_index=0))
    worker._handle(prefill_request("one", api_index=1))
    worker._handle(Abort([], api_index=1))
    assert list(worker.requests) == ["zero"]


def test_held_tokens_go_with_the_last_output_and_the_request_with_them(plane):
    worker = plane.make("pd")
    worker._handle(prefill_request("r"))
    state = worker.requests["r"]
    first = worker._hold(state, TokenOutput("r", [7], index=0), stream_interval=3)
    assert first is not None and state.held is None  # the first token goes at once
    assert worker._hold(state, TokenOutput("r", [8], index=1), stream_interval=3) is None
    assert state.held.token_ids == [8]
    last = worker._hold(state, TokenOutput("r", [9], finished=True, finish_reason="length", index=2),
                        stream_interval=3)
    assert last.token_ids == [8, 9] and last.finished and state.held is None
    worker._send_step_outputs([last])
    assert worker.requests == {}
    assert plane.collectors[0].recv(timeout_s=5).outputs[0].token_ids == [8, 9]


def test_a_request_the_engine_dropped_is_answered_for_a_retry_and_forgotten(plane):
    """A decode engine out of blocks drops an image request it cannot recompute
    (engine/scheduler.py `_drop_stalled`): an internal error, so the API resumes
    it elsewhere, and nothing of it stays here."""
    worker = plane.make("decode")
    worker._handle(kv_transfer("r", plane.decode.address, api_index=1))
    worker._admit_transfers()
    assert plane.decode.recv(timeout_s=5).request_id == "r"  # its KVAck
    worker.core.result = StepResult(dropped=["r"])
    worker._step()
    out = plane.collectors[1].recv(timeout_s=5)
    assert isinstance(out, TokenOutput) and (out.request_id, out.finish_reason) == ("r", "error")
    assert out.is_internal_error and "KV cache block" in out.error
    assert worker.requests == {}
