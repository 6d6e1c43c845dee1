"""KV events in vLLM's format (engine/kv_event_log.py, transport/wire/kv_events.py,
transport/wire/kv_event_publisher.py): a scheduler driven step by step records
them, a real PUB socket carries them, and (a) vLLM's own classes decode the
stream, (b) a subscriber that knows only the events rebuilds exactly the set of
blocks the block manager can hit, after hits, evictions and a reset, (c) a
missed range comes back from the replay socket."""
from __future__ import annotations

import dataclasses
import json
import threading

import pytest
import zmq

from epd.cli.engine_flags import engine_config_of
from epd.engine.config import EngineConfig
from epd.engine.engine_core import EngineCore
from epd.engine.scheduler import Scheduler
from epd.engine.scheduler_config import SchedulerConfig
from epd.engine.worker.loop import EngineWorker
from epd.transport.wire.addresses import Addresses
from epd.transport.wire.channels import Receiver, Sender
from epd.transport.wire.kv_event_publisher import END_SEQ, KVEventPublisher
from epd.transport.wire.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventsConfig,
                                          decode_event_batch, external_block_hash)
from epd.transport.wire.lora_request import LoRARequest
from epd.transport.wire.messages import PrefillRequest, Shutdown, TokenOutputs
from epd.transport.wire.sampling import SamplingParams
from epd.transport.wire.worker_io import WorkerSpec

from testkit.engine_factories import add_request, cpu_llm, fake_run, image_request, make_request
from testkit.vllm_kv_events_reference import decode_with_vllm, vllm_python

BLOCK_SIZE = 4


@pytest.fixture
def plane(tmp_path):
    """A publisher on ipc sockets and a subscriber connected to it (seen to receive)."""
    ctx = zmq.Context.instance()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/kv",
                            replay_endpoint=f"ipc://{tmp_path}/kv-replay", buffer_steps=4, topic="kv@w0")
    publisher = KVEventPublisher(config, ctx)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(config.endpoint)
    yield publisher, sub
    sub.close()
    publisher.close()


def receive(sub, num_batches: int) -> list[tuple[bytes, int, bytes]]:
    frames = []
    for _ in range(num_batches):
        assert sub.poll(5000), "no batch published"
        topic, seq, payload = sub.recv_multipart()
        frames.append((topic, int.from_bytes(seq, "big"), payload))
    return frames


def connect_subscriber(publisher: KVEventPublisher, sub) -> None:
    """PUB drops what is sent before a subscription arrives: wait until one gets through
    (those probe batches are sequence numbers too; a fresh publisher's first is 0)."""
    for _ in range(200):
        publisher.publish([AllBlocksCleared()])
        if sub.poll(25):
            sub.recv_multipart()
            break
    else:
        raise AssertionError("the subscriber never connected")
    while sub.poll(100):  # probes that were still on their way
        sub.recv_multipart()


def workload_scheduler(num_blocks: int) -> Scheduler:
    config = SchedulerConfig(block_size=BLOCK_SIZE, max_num_seqs=4, max_num_batched_tokens=64)
    return Scheduler(config, num_blocks, kv_events=True)


def run_workload(scheduler: Scheduler, publisher: KVEventPublisher, reset_after: int | None = None) -> int:
    """Requests with shared prefixes (hits), an image twice, an adapter, more than the cache holds
    (evictions), each step's events published; returns how many batches went out."""
    adapter = LoRARequest("sql", 1, "/adapters/sql")
    requests = [make_request(10, request_id="a"), make_request(10, request_id="b"),  # b hits a's blocks
                image_request(["img-1"], num_image_tokens=6, request_id="i1"),
                image_request(["img-1"], num_image_tokens=6, request_id="i2"),
                dataclasses.replace(make_request(9, request_id="l1"), lora_request=adapter),
                make_request(prompt_token_ids=list(range(2000, 2014)), request_id="c"),
                make_request(prompt_token_ids=list(range(3000, 3014)), request_id="d"),
                make_request(10, request_id="e")]
    num_batches = 0
    for i, request in enumerate(requests):
        add_request(scheduler, request)
        while scheduler.has_unfinished():
            output = scheduler.schedule()
            scheduler.update(output, fake_run(output))
            events = scheduler.block_manager.kv_events.take()
            num_batches += bool(events)
            publisher.publish(events)
        if i == reset_after:
            scheduler.block_manager.reset_prefix_cache()
            publisher.publish(scheduler.block_manager.kv_events.take())
            num_batches += 1
    return num_batches


def rebuild(frames) -> set[int]:
    """An independent subscriber's view: the block hashes the worker holds, from events alone."""
    cached: set[int] = set()
    for _, _, payload in frames:
        _, events, _ = decode_event_batch(payload)
        for event in events:
            if isinstance(event, BlockStored):
                assert len(event.token_ids) == len(event.block_hashes) * event.block_size
                cached.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert cached >= set(event.block_hashes), "a block removed that was never stored"
                cached.difference_update(event.block_hashes)
            else:
                cached.clear()
    return cached


def test_a_subscriber_rebuilds_exactly_the_blocks_the_worker_can_hit(plane):
    publisher, sub = plane
    connect_subscriber(publisher, sub)
    scheduler = workload_scheduler(num_blocks=12)  # fewer than the workload's blocks: evictions
    num_batches = run_workload(scheduler, publisher, reset_after=2)
    frames = receive(sub, num_batches)
    assert [seq for _, seq, _ in frames] == list(range(frames[0][1], frames[0][1] + num_batches))  # no gap
    events = [e for _, _, p in frames for e in decode_event_batch(p)[1]]
    kinds = {type(e) for e in events}
    assert kinds == {BlockStored, BlockRemoved, AllBlocksCleared}
    manager = scheduler.block_manager
    assert manager.prefix_cache_hits > 0
    expected = {external_block_hash(h) for h in manager.cached_block_hashes()}
    assert expected and rebuild(frames) == expected

    stored = [e for e in events if isinstance(e, BlockStored)]
    lora = [e for e in stored if e.lora_name == "sql"]
    assert lora and all(e.lora_id == 1 and all(k[0] == "sql" for k in e.extra_keys) for e in lora)
    image = [e for e in stored if e.extra_keys and any(isinstance(k, tuple) for keys in e.extra_keys
                                                       if keys for k in keys)]
    # i1: 2 text tokens, 6 placeholders from position 2: blocks 0 and 1 hold them, at offsets 2 and -2
    assert image[0].extra_keys[:2] == [(("img-1", 2),), (("img-1", -2),)] and image[0].parent_block_hash is None


def test_vllm_decodes_the_stream_with_its_own_classes(plane):
    if vllm_python() is None:
        pytest.skip("vLLM's venv is absent (EPD_VLLM_PYTHON, default /work/vllm-venv/bin/python)")
    publisher, sub = plane
    connect_subscriber(publisher, sub)
    num_batches = run_workload(workload_scheduler(num_blocks=12), publisher, reset_after=5)
    payloads = [p for _, _, p in receive(sub, num_batches)]
    answers = decode_with_vllm(payloads)
    assert all(a["same_bytes"] for a in answers)  # vLLM's msgspec writes back the very same bytes
    for payload, answer in zip(payloads, answers):
        ts, events, rank = decode_event_batch(payload)
        assert (answer["ts"], answer["data_parallel_rank"]) == (ts, rank)
        assert [a.pop("class") for a in answer["events"]] == [type(e).__name__ for e in events]
        assert answer["events"] == [json.loads(json.dumps(e.to_wire())) for e in events]  # tuples as lists
    classes = {a_event["type"] for a in answers for a_event in a["events"]}
    assert classes == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}


def replay(publisher: KVEventPublisher, dealer, start_seq: int) -> list[int]:
    """Asks for the batches from `start_seq` as a vLLM subscriber does; the sequence numbers that came."""
    dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
    while not publisher.serve_replays():  # the worker answers between its steps
        assert not dealer.poll(10)
    seqs = []
    while True:
        assert dealer.poll(5000)
        empty, topic, seq, payload = dealer.recv_multipart()
        if seq == END_SEQ:
            return seqs
        assert (empty, topic) == (b"", b"kv@w0")
        assert decode_event_batch(payload)[1] == [BlockRemoved([int.from_bytes(seq, "big")])]
        seqs.append(int.from_bytes(seq, "big"))


def test_a_missed_range_comes_back_from_the_replay_socket(plane):
    publisher, _ = plane
    for i in range(6):  # buffer_steps=4: batches 2..5 are kept
        publisher.publish([BlockRemoved([i])])
    publisher.publish([])  # a step that changed nothing sends nothing, takes no number
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(publisher.config.replay_endpoint)
    try:
        assert replay(publisher, dealer, 3) == [3, 4, 5]
        assert replay(publisher, dealer, 0) == [2, 3, 4, 5]  # older ones are gone
        assert replay(publisher, dealer, 6) == []
    finally:
        dealer.close()


def test_the_config_takes_vllms_keys_and_names_a_wrong_one():
    flag = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:6557"}'
    config = engine_config_of(["--kv-events-config", flag]).kv_events_config  # epd serve's and epd worker's flag
    assert config.is_on and (config.publisher, config.buffer_steps, config.hwm) == ("zmq", 10_000, 100_000)
    assert engine_config_of([]).kv_events_config is None
    assert not KVEventsConfig.parse('{"enable_kv_cache_events": false}').is_on
    assert config.for_rank(2).endpoint == "tcp://*:5559" and config.for_rank(2).replay_endpoint == "tcp://*:6559"
    assert KVEventsConfig(True, endpoint="ipc:///tmp/kv").for_rank(1).endpoint == "ipc:///tmp/kv_dp1"
    with pytest.raises(ValueError, match="EPD does not read enable_events"):
        KVEventsConfig.parse('{"enable_events": true}')
    with pytest.raises(ValueError, match="publisher must be one of null, zmq"):
        KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "kafka"})
    with pytest.raises(ValueError, match="buffer_steps must be a positive int"):
        KVEventsConfig.parse({"buffer_steps": 0})
    with pytest.raises(ValueError, match="not valid JSON"):
        KVEventsConfig.parse("{enable")


def test_the_offline_llm_refuses_events_it_could_not_publish(tiny_model):
    with pytest.raises(ValueError, match="offline LLM has no publisher"):
        cpu_llm(tiny_model, kv_events_config={"enable_kv_cache_events": True})


def test_an_engine_worker_publishes_what_its_engine_caches(tiny_model, tmp_path):
    """The real worker loop around the real engine (a tiny checkpoint): requests in through its
    inbox, each step's events out on its PUB socket, rebuilt to the engine's own cached set; the
    whole stream again from its replay socket (the subscriber may have joined late), the same."""
    config = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/kv",
              "replay_endpoint": f"ipc://{tmp_path}/kv-replay"}
    core = EngineCore(tiny_model, EngineConfig.from_flat(dtype="float32", device="cpu", num_kv_blocks=6,
                                                         kv_events_config=config))  # 16-token blocks: evictions
    addresses = Addresses.ipc(tmp_path)
    collector = Receiver(addresses.collector(0))
    spec = WorkerSpec("pd-0", "pd", addresses.worker("pd", 0), (collector.address,), None, 0)
    worker = EngineWorker(spec, core)
    worker.heartbeat.interval_s = 3600.0
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(config["endpoint"])
    inbox = Sender(spec.inbox)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(config["replay_endpoint"])
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    try:
        prompts = {"a": list(range(10, 50)), "b": list(range(10, 50)), "c": list(range(60, 100)),
                   "d": list(range(110, 150)), "e": list(range(10, 45))}  # b and e hit a's blocks
        frames = []
        for request_id, token_ids in prompts.items():  # one at a time: a subscriber joins before the first
            inbox.send(PrefillRequest(request_id, token_ids, [], greedy, [], None))
            while True:
                out = collector.recv(timeout_s=30)
                assert out is not None, "no answer from the worker"
                if isinstance(out, TokenOutputs) and any(o.finished for o in out.outputs):
                    break
            while sub.poll(200):
                topic, seq, payload = sub.recv_multipart()
                frames.append((topic, int.from_bytes(seq, "big"), payload))
        manager = core.scheduler.block_manager
        assert manager.prefix_cache_hits > 0
        events = [e for _, _, p in frames for e in decode_event_batch(p)[1]]
        assert any(isinstance(e, BlockRemoved) for e in events)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])  # answered by the idle loop
        replayed = []
        while True:
            assert dealer.poll(10_000), "no replay"
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                break
            replayed.append((topic, int.from_bytes(seq, "big"), payload))
        assert [seq for _, seq, _ in replayed] == list(range(len(replayed)))
        assert frames and set(frames) <= set(replayed) and frames[-1] == replayed[-1]  # live: all but a late join's
        assert rebuild(replayed) == {external_block_hash(h) for h in manager.cached_block_hashes()}
    finally:
        inbox.send(Shutdown())
        thread.join(timeout=30)
        inbox.close()
        dealer.close()
        sub.close()
        collector.close()


def test_each_engine_worker_of_a_deployment_publishes_on_its_own_port(tiny_model, tmp_path):
    from epd.config import ServeConfig
    from epd.processes.worker_launches import worker_launches

    events = KVEventsConfig(True, endpoint="tcp://*:5557", replay_endpoint="tcp://*:5600")
    config = ServeConfig(model=tiny_model, mode="e-pd", num_prefill=2, engine=EngineConfig(kv_events_config=events))
    launches = worker_launches(config, Addresses.ipc(tmp_path), ("ipc://collector",), str(tmp_path / "mm"))
    engines = [launch.engine.kv_events_config for launch in launches if launch.spec.role.holds_kv]
    assert [(e.endpoint, e.replay_endpoint) for e in engines] == [("tcp://*:5557", "tcp://*:5600"),
                                                                  ("tcp://*:5558", "tcp://*:5601")]
