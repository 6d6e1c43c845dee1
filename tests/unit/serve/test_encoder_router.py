"""The encoder router's choice, torch-free: workers are plain records with the
two counters the router reads from an encoder's latest WorkerStats."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from epd.serve.encoder_router import EncoderRouter


@dataclass
class _Counters:
    num_queued_patches: int = 0
    num_requests_received: int = 0


@dataclass
class _Stats:
    encoder: _Counters


@dataclass
class _Encoder:
    worker_id: str
    stats: _Stats | None = None

    def report(self, queued: int, received: int) -> None:
        self.stats = _Stats(_Counters(queued, received))


def _encoders(n: int) -> list[_Encoder]:
    return [_Encoder(f"encoder-{i}") for i in range(n)]


def _send(router: EncoderRouter, encoders, images) -> list[str]:
    """Routes one request's images and sends them, as the orchestrator does; returns worker ids."""
    chosen = router.assign(encoders, images)
    for (key, patches), enc in zip(images, chosen):
        router.on_sent(enc, key, patches)
    return [e.worker_id for e in chosen]


def _key(i: int) -> str:
    return f"{i:064x}"


def _finish_times(encoders, images, chosen_ids) -> dict[str, int]:
    finish = {e.worker_id: 0 for e in encoders}
    for (_, patches), wid in zip(images, chosen_ids):
        finish[wid] += patches
    return finish


def test_largest_image_first_so_the_last_image_finishes_earliest():
    encoders = _encoders(2)
    images = [(_key(0), 100), (_key(1), 100), (_key(2), 400), (_key(3), 100)]
    chosen = _send(EncoderRouter("cost"), encoders, images)
    # the large image alone on one encoder, the three small ones on the other: done at 400 patches
    assert chosen[2] not in (chosen[0], chosen[1], chosen[3])
    assert max(_finish_times(encoders, images, chosen).values()) == 400
    rr = _send(EncoderRouter("round_robin"), _encoders(2), images)
    assert max(_finish_times(encoders, images, rr).values()) == 500  # in turn: 100 + 400 on one encoder


def test_queued_patches_in_stats_steer_images_away():
    encoders = _encoders(3)
    encoders[0].report(queued=5000, received=0)
    encoders[1].report(queued=300, received=0)
    router = EncoderRouter("cost")
    assert _send(router, encoders, [(_key(0), 200)]) == ["encoder-2"]
    assert _send(router, encoders, [(_key(1), 200)]) == ["encoder-2"]  # 200 in flight there < 300 queued
    assert _send(router, encoders, [(_key(2), 200)]) == ["encoder-1"]  # now 400 in flight > 300
    assert router.backlog(encoders[0]) == 5000


def test_a_burst_between_reports_is_spread():
    encoders = _encoders(2)
    router = EncoderRouter("cost")
    picks = [_send(router, encoders, [(_key(i), 64)])[0] for i in range(10)]
    assert picks.count("encoder-0") == picks.count("encoder-1") == 5
    assert router.backlog(encoders[0]) == router.backlog(encoders[1]) == 5 * 64


def test_work_the_encoder_reported_receiving_leaves_the_in_flight_count():
    enc = _Encoder("encoder-0")
    router = EncoderRouter("cost")
    for i, patches in enumerate([10, 20, 40]):
        router.on_sent(enc, _key(i), patches)
    assert router.backlog(enc) == 70  # no report yet: all in flight
    enc.report(queued=25, received=2)  # it holds the first two (15 of their 30 patches left), the third is on its way
    assert router.backlog(enc) == 25 + 40
    enc.report(queued=0, received=3)
    assert router.backlog(enc) == 0
    router.on_sent(enc, _key(3), 8)
    assert router.backlog(enc) == 8


def test_a_repeated_image_goes_back_to_its_encoder_unless_that_queue_is_much_longer():
    encoders = _encoders(2)
    router = EncoderRouter("cost")
    first = _send(router, encoders, [(_key(7), 300)])[0]
    holder, other = (encoders[0], encoders[1]) if first == "encoder-0" else (encoders[1], encoders[0])
    holder.report(queued=250, received=1)  # longer than the other's, by less than the image's cost
    other.report(queued=0, received=0)
    assert _send(router, encoders, [(_key(7), 300)]) == [holder.worker_id]
    holder.report(queued=900, received=2)  # longer by more than the image's cost: encode it again elsewhere
    assert _send(router, encoders, [(_key(7), 300)]) == [other.worker_id]
    assert _send(router, encoders, [(_key(7), 300)]) == [other.worker_id]  # it now holds the image


def test_repeats_faster_than_the_holders_reports_stay_with_the_holder():
    """A repeat is answered from the holder's cache: sent before the holder's
    next report it adds nothing to its backlog, however many follow (a client
    asking about the same image in quick turns), whichever encoder's turn it is."""
    encoders = _encoders(2)
    router = EncoderRouter("cost")
    holder_id = _send(router, encoders, [(_key(9), 24)])[0]
    holder = next(e for e in encoders if e.worker_id == holder_id)
    holder.report(queued=0, received=1)
    for _ in range(5):  # no report in between
        assert _send(router, encoders, [(_key(9), 24)]) == [holder_id]
        assert router.backlog(holder) == 0
    [first] = _send(router, encoders, [(_key(10), 24)])  # a new image counts in full...
    assert router.backlog(next(e for e in encoders if e.worker_id == first)) == 24
    assert _send(router, encoders, [(_key(11), 24)]) != [first]  # ...and steers the next one away


def test_a_restarted_encoder_is_forgotten():
    encoders = _encoders(2)
    router = EncoderRouter("cost", max_remembered=2)
    home = _send(router, encoders, [(_key(1), 50)])[0]
    idx = int(home[-1])
    router.on_ready(home)  # new process: empty queue, its own cache gone
    encoders[idx].report(queued=0, received=0)
    assert router.backlog(encoders[idx]) == 0
    encoders[idx].report(queued=40, received=0)
    # no longer the holder: the image goes to the idle encoder, not to the one with 40 patches queued
    assert _send(router, encoders, [(_key(1), 50)]) == [encoders[1 - idx].worker_id]


def test_locality_memory_is_bounded():
    encoders = _encoders(2)
    router = EncoderRouter("cost", max_remembered=2)
    for i in range(5):
        router.on_sent(encoders[0], _key(i), 10)
    assert len(router._holder) == 2 and list(router._holder) == [_key(3), _key(4)]


def test_round_robin_is_kept():
    router = EncoderRouter("round_robin")
    encoders = _encoders(3)
    encoders[0].report(queued=10_000, received=0)  # ignored in turn
    assert _send(router, encoders, [(_key(i), 10) for i in range(6)]) == ["encoder-0", "encoder-1", "encoder-2"] * 2


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown encoder router"):
        EncoderRouter("fastest")
