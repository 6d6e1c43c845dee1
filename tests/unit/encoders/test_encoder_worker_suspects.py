"""What an encoder worker tells the API of the batch it runs (issue 44, item 1):
each batch starts with an `Alive` naming its requests and ends with one naming
none, on the loop's own socket, before the stats; an item sent `alone` (its
request a suspect of an earlier death) gets a batch of its own; an Abort drops
queued items unencoded. Over real ZeroMQ, with the tiny checkpoint's tower."""
from __future__ import annotations

import hashlib
import time

import pytest
import torch

from epd.encoders.encoder_worker import EncoderWorker
from epd.encoders.image_encoder import ImageEncoder
from epd.transport.wire.addresses import Addresses
from epd.transport.wire.channels import Receiver
from epd.transport.wire.messages import Abort, Alive, EncodeDone, EncodeRequest
from epd.transport.wire.worker_io import WorkerSpec
from testkit.media import image_bytes


@pytest.fixture
def plane(tiny_model, tmp_path):
    from transformers import AutoConfig

    addresses = Addresses.ipc(tmp_path)
    collector, prefill = Receiver(addresses.collector(0)), Receiver(addresses.worker("prefill", 0))
    encoder = ImageEncoder(tiny_model, AutoConfig.from_pretrained(tiny_model), torch.float32, model_fingerprint="fp")
    spec = WorkerSpec("encoder-0", "encoder", addresses.worker("encoder", 0), (collector.address,), None, 0)
    worker = EncoderWorker(spec, encoder)
    yield worker, collector, prefill
    worker.close()
    collector.close()
    prefill.close()


def _request(request_id: str, seed: int, prefill: Receiver, alone: bool = False) -> EncodeRequest:
    data = image_bytes(64, 48, seed=seed)
    return EncodeRequest(request_id, hashlib.sha256(data).hexdigest(), data, reply_to=prefill.address, alone=alone)


def _said(collector: Receiver) -> list[list[str]]:
    """The `working_on` of every Alive the loop sent, in order."""
    said = []
    while (msg := collector.recv(timeout_s=0.5)) is not None:
        if isinstance(msg, Alive) and msg.working_on is not None:
            said.append(msg.working_on)
    return said


def _done(prefill: Receiver) -> list[str]:
    out = []
    while (msg := prefill.recv(timeout_s=0.5)) is not None:
        assert isinstance(msg, EncodeDone) and msg.ok
        out.append(msg.request_id)
    return out


def test_a_batch_says_which_requests_it_holds_as_it_starts_and_ends(plane):
    worker, collector, prefill = plane
    for i, request_id in enumerate(["r1", "r2"]):
        worker._enqueue(_request(request_id, i, prefill), time.perf_counter())
    worker._encode_batch()  # both in one batch: the tower's patch budget takes them
    assert _said(collector) == [["r1", "r2"], []]
    assert sorted(_done(prefill)) == ["r1", "r2"]


def test_an_item_sent_alone_is_a_batch_of_its_own(plane):
    worker, collector, prefill = plane
    worker._enqueue(_request("r1", 1, prefill), time.perf_counter())
    worker._enqueue(_request("r2~retry1", 2, prefill, alone=True), time.perf_counter())
    worker._enqueue(_request("r3", 3, prefill), time.perf_counter())
    while worker.queue:
        worker._encode_batch()
    assert _said(collector) == [["r1"], [], ["r2~retry1"], [], ["r3"], []]
    assert _done(prefill) == ["r1", "r2~retry1", "r3"]


def test_an_abort_drops_queued_items_unencoded(plane):
    worker, collector, prefill = plane
    worker._enqueue(_request("r1", 1, prefill), time.perf_counter())
    worker._enqueue(_request("r2", 2, prefill), time.perf_counter())
    worker.arrivals.start()  # the thread that reads the inbox (run() starts it)
    try:
        worker.outbox.send(worker.inbox.address, Abort(["r2"]))  # as the API sends it
        deadline = time.monotonic() + 10
        while len(worker.queue) == 2:
            assert time.monotonic() < deadline, "the Abort never arrived"
            worker._drain(timeout_s=0.1)
    finally:
        worker.arrivals.stop()
    while worker.queue:
        worker._encode_batch()
    assert _done(prefill) == ["r1"]
    assert worker.counters.num_aborted == 1 and worker.counters.num_images == 1
