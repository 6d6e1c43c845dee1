"""The encoder router with tower adapters (--enable-tower-lora): an encode request
carrying one goes to an encoder that holds it in a slot when its load is close
(router.prefer_adapter's rule), else as without; real WorkerInfo records holding
WorkerStats as they come off the wire."""
from __future__ import annotations

from epd.serve.encoder_router import EncoderRouter
from epd.serve.registry import WorkerInfo
from epd.transport.wire.messages import WorkerStats, decode_message
from epd.transport.wire.wire_values import EncoderCounters, LoRAState


def _key(i: int) -> str:
    return f"{i:064x}"


def _report(encoder: WorkerInfo, queued: int, resident: tuple[str, ...] = (), patches: int = 0) -> None:
    """`queued` EncodeRequests of `patches` patches each, and `resident` tower adapters, sent over the wire."""
    sent = WorkerStats(encoder.worker_id, "encoder", num_running=0, num_waiting=queued, num_free_blocks=0,
                       num_total_blocks=0, queue_depth=queued,
                       encoder=EncoderCounters(num_queued_patches=queued * patches),
                       lora=LoRAState(resident=resident, max_lora=2))
    encoder.stats = decode_message([bytes(f) for f in sent.to_wire()])


def _encoders(n: int) -> list[WorkerInfo]:
    out = [WorkerInfo(f"encoder-{i}", "encoder", f"ipc:///tmp/x/encoder-{i}.sock") for i in range(n)]
    for e in out:
        _report(e, 0)
    return out


def _ids(chosen) -> list[str]:
    return [e.worker_id for e in chosen]


def test_an_encoder_holding_the_tower_adapter_takes_its_images_when_loads_are_close():
    encoders = _encoders(3)
    _report(encoders[1], 1, ("sql",), patches=100)  # one image queued more than the idle ones, "sql" in a slot
    for policy in ("cost", "round_robin"):
        router = EncoderRouter(policy)
        images = [(_key(0), 64), (_key(1), 64)]
        assert _ids(router.assign(encoders, images, "sql")) == ["encoder-1", "encoder-1"]
        # the base tower, or an adapter resident nowhere: as without adapters (the idle encoders)
        assert "encoder-1" not in _ids(EncoderRouter(policy).assign(encoders, images[:1]))
        assert "encoder-1" not in _ids(EncoderRouter(policy).assign(encoders, images[:1], "chat"))


def test_a_busy_encoder_holding_the_adapter_is_passed_over():
    encoders = _encoders(3)
    _report(encoders[1], 2, ("sql",), patches=100)  # 4 (waiting + queued) over the least loaded: past max(2, 0)
    assert "encoder-1" not in _ids(EncoderRouter("cost").assign(encoders, [(_key(0), 64)], "sql"))
    _report(encoders[2], 1, ("sql",), patches=100)  # within the slack: the warm one of the two
    assert _ids(EncoderRouter("cost").assign(encoders, [(_key(0), 64)], "sql")) == ["encoder-2"]


def test_an_images_holder_stays_a_candidate_without_the_adapter():
    encoders = _encoders(3)
    router = EncoderRouter("cost")
    router.on_sent(encoders[0], _key(7), 64)  # encoder-0 encoded this (adapted) image last: a cache read there
    _report(encoders[0], 0, ())  # its slot since taken by another adapter
    _report(encoders[2], 0, ("sql",))
    assert _ids(router.assign(encoders, [(_key(7), 64), (_key(8), 64)], "sql")) == ["encoder-0", "encoder-2"]
