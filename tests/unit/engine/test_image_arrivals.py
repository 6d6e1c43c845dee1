"""ImageArrivals: requests wait for their images, images (and failures) for
their requests, until they reach the engine. With early prefill a request
reaches it at once; the engine's ImageLedger (a real one here) then knows
which images it waits for."""
from __future__ import annotations

import subprocess
import sys

from epd.engine.worker.image_arrivals import Admit, Failed, ImageArrivals
from epd.engine.image_ledger import ImageLedger
from epd.transport.wire.mm_span import MMSpan

from testkit.engine_factories import IMAGE_PAD_ID, make_request


def image_request(request_id: str, mm_hashes: list[str]):
    token_ids, spans = [1], []
    for mm_hash in mm_hashes:
        spans.append(MMSpan(len(token_ids), 2, mm_hash, {"grid_thw": (1, 2, 4)}))
        token_ids += [IMAGE_PAD_ID] * 2 + [9]
    return make_request(request_id=request_id, prompt_token_ids=token_ids, mm_spans=spans)


def make_arrivals(held: dict[str, str] | None = None, max_early: int = 256, early: bool = False):
    """Embeddings are opaque here: strings stand in for MMEntry. `held` plays
    the engine and the cache; the list records every lookup."""
    held = dict(held or {})
    lookups: list[str] = []

    def lookup(mm_hash):
        lookups.append(mm_hash)
        return held.get(mm_hash)

    return ImageArrivals(lookup, max_early=max_early, early=early), held, lookups


def admitted(outcomes) -> dict[str, dict[str, str]]:
    assert all(isinstance(o, Admit) for o in outcomes), outcomes
    return {o.request.request_id: o.embeddings for o in outcomes}


def test_text_and_held_images_are_ready_at_once():
    arrivals, _, lookups = make_arrivals({"cat": "emb-cat"})
    assert admitted(arrivals.add(image_request("text", []))) == {"text": {}}
    assert admitted(arrivals.add(image_request("r", ["cat", "cat"]))) == {"r": {"cat": "emb-cat"}}
    assert lookups == ["cat"]  # one lookup per distinct image
    assert arrivals.num_pending == 0


def test_a_request_waits_for_its_missing_images():
    arrivals, _, _ = make_arrivals({"cat": "emb-cat"})
    assert arrivals.add(image_request("r", ["cat", "dog", "owl"])) == []
    assert "r" in arrivals and arrivals.num_pending == 1
    assert arrivals.arrived("dog", "emb-dog") == []
    assert admitted(arrivals.arrived("owl", "emb-owl")) == {
        "r": {"cat": "emb-cat", "dog": "emb-dog", "owl": "emb-owl"}}
    assert arrivals.num_pending == 0 and "r" not in arrivals


def test_one_arrival_completes_every_request_waiting_for_it():
    arrivals, _, _ = make_arrivals()
    arrivals.add(image_request("a", ["cat"]))
    arrivals.add(image_request("b", ["dog", "cat"]))
    arrivals.add(image_request("c", ["cat"]))
    assert admitted(arrivals.arrived("cat", "emb-cat")) == {"a": {"cat": "emb-cat"}, "c": {"cat": "emb-cat"}}
    assert admitted(arrivals.arrived("dog", "emb-dog")) == {"b": {"dog": "emb-dog", "cat": "emb-cat"}}


def test_an_image_staged_for_one_request_serves_the_next():
    """Once here, an image stays staged while any pending request needs it,
    even when the engine or the cache no longer has it."""
    arrivals, held, lookups = make_arrivals({"cat": "emb-cat"})
    arrivals.add(image_request("a", ["cat", "dog"]))
    del held["cat"]  # e.g. the engine dropped it
    assert admitted(arrivals.add(image_request("b", ["cat"]))) == {"b": {"cat": "emb-cat"}}
    assert lookups == ["cat", "dog"]
    assert admitted(arrivals.arrived("dog", "emb-dog")) == {"a": {"cat": "emb-cat", "dog": "emb-dog"}}
    # Nobody pending: nothing staged any more, so the next request looks it up again.
    assert arrivals.add(image_request("c", ["cat"])) == []


def test_an_image_before_its_request_is_kept():
    arrivals, _, lookups = make_arrivals()
    assert arrivals.arrived("cat", "emb-cat") == []  # its EncodeDone overtook the request
    assert admitted(arrivals.add(image_request("r", ["cat"]))) == {"r": {"cat": "emb-cat"}}
    assert lookups == []
    assert arrivals.add(image_request("s", ["cat"])) == []  # used up: not kept twice


def test_early_images_are_bounded_oldest_first():
    arrivals, _, _ = make_arrivals(max_early=2)
    for mm_hash in ("a", "b", "c"):
        arrivals.arrived(mm_hash, f"emb-{mm_hash}")
    assert arrivals.add(image_request("r", ["a"])) == []  # forgotten
    assert admitted(arrivals.add(image_request("s", ["b", "c"]))) == {"s": {"b": "emb-b", "c": "emb-c"}}


def test_a_failed_image_fails_every_request_waiting_for_it():
    arrivals, _, _ = make_arrivals()
    arrivals.add(image_request("a", ["cat"]))
    arrivals.add(image_request("b", ["cat", "dog"]))
    arrivals.add(image_request("c", ["dog"]))
    assert arrivals.failed("cat", "bad image", request_id="a") == [Failed("a", "bad image"),
                                                                   Failed("b", "bad image")]
    assert arrivals.num_pending == 1
    assert admitted(arrivals.arrived("dog", "emb-dog")) == {"c": {"dog": "emb-dog"}}
    assert arrivals.add(image_request("a", ["cat"])) == []  # a failure is not remembered for one it failed


def test_a_failure_before_its_request_fails_it_on_arrival():
    arrivals, _, lookups = make_arrivals()
    assert arrivals.failed("cat", "bad image", request_id="r") == []
    assert arrivals.add(image_request("r", ["cat"])) == [Failed("r", "bad image")]
    assert arrivals.num_pending == 0 and lookups == []
    assert arrivals.add(image_request("r2", ["cat"])) == []  # only that request


def test_early_failures_are_bounded():
    arrivals, _, _ = make_arrivals(max_early=1)
    arrivals.failed("cat", "first", request_id="r1")
    arrivals.failed("dog", "second", request_id="r2")
    assert arrivals.add(image_request("r1", ["cat"])) == []
    assert arrivals.add(image_request("r2", ["dog"])) == [Failed("r2", "second")]


def test_an_image_written_to_the_cache_is_found_there_or_fails_the_waiting():
    """An EncodeDone without tensors (engine/worker/loop.py): `find` reads the image
    back; one already gone fails those waiting for it (the worker's error
    text for that is checked in test_early_prefill.py)."""
    arrivals, held, _ = make_arrivals()
    arrivals.add(image_request("a", ["cat"]))
    arrivals.add(image_request("b", ["dog"]))
    held["cat"] = "emb-cat"
    assert arrivals.find("cat") == "emb-cat"
    assert admitted(arrivals.arrived("cat", "emb-cat")) == {"a": {"cat": "emb-cat"}}
    assert arrivals.find("dog") is None
    evicted = arrivals.failed("dog", "evicted")
    assert [f.request_id for f in evicted] == ["b"]
    assert arrivals.num_pending == 0


def test_an_image_the_engine_took_is_not_kept_for_later():
    arrivals, held, lookups = make_arrivals()
    assert arrivals.arrived("cat", "emb-cat", is_taken=True) == []
    assert arrivals.find("cat") is None and lookups == ["cat"]  # not kept: only looked up
    assert arrivals.arrived("dog", "emb-dog") == []
    assert arrivals.find("dog") == "emb-dog" and lookups == ["cat"]  # kept, taken once
    assert arrivals.find("dog") is None


def test_removing_a_pending_request_unstages_its_images():
    arrivals, held, _ = make_arrivals({"cat": "emb-cat"})
    arrivals.add(image_request("r", ["cat", "dog"]))
    assert arrivals.remove("r") and not arrivals.remove("r")
    assert arrivals.num_pending == 0
    del held["cat"]
    assert arrivals.add(image_request("s", ["cat"])) == []  # not staged any more
    assert arrivals.arrived("dog", "emb-dog") == []  # nobody waits: kept for later


def test_image_arrivals_does_not_import_torch():
    code = "import sys, epd.engine.worker.image_arrivals; assert 'torch' not in sys.modules, 'torch was imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_request_waiting_too_long_for_an_image_gives_up():
    arrivals, _, _ = make_arrivals()
    assert arrivals.add(image_request("old", ["cat"]), now_s=100.0) == []
    assert arrivals.add(image_request("new", ["cat", "dog"]), now_s=150.0) == []
    assert arrivals.expire(now_s=160.0, max_wait_s=60.0) == []
    [failed] = arrivals.expire(now_s=161.0, max_wait_s=60.0)
    assert isinstance(failed, Failed) and failed.request_id == "old" and "gave up" in failed.error
    assert "old" not in arrivals and "new" in arrivals
    assert admitted(arrivals.arrived("cat", "emb-cat")) == {}  # "new" still misses "dog"
    assert admitted(arrivals.arrived("dog", "emb-dog")) == {"new": {"cat": "emb-cat", "dog": "emb-dog"}}
    assert arrivals.expire(now_s=10_000.0, max_wait_s=60.0) == []  # admitted requests are not waiting


def admit_to(ledger: ImageLedger, outcomes) -> list[Admit]:
    """As the worker's `_admit` (EngineCore.add_request): each Admit enters the engine's ledger."""
    for admit in outcomes:
        assert isinstance(admit, Admit), admit
        ledger.add(admit.request, admit.embeddings, admit.pending)
    return outcomes


def hand_on(arrivals: ImageArrivals, ledger: ImageLedger, mm_hash: str, entry: str) -> list:
    """As the worker's `_image_arrived`: the engine first (EngineCore.add_embedding), then the held requests."""
    return arrivals.arrived(mm_hash, entry, is_taken=ledger.arrived(mm_hash, entry))


def test_early_a_request_is_admitted_at_once_and_its_images_follow_it():
    arrivals, _, _ = make_arrivals({"cat": "emb-cat"}, early=True)
    ledger = ImageLedger()
    [ready] = admit_to(ledger, arrivals.add(image_request("r", ["cat", "dog", "owl"])))
    assert ready.embeddings == {"cat": "emb-cat"} and ready.pending == {"dog", "owl"}
    assert arrivals.num_pending == 0 and "r" not in arrivals  # admitted: the ledger knows what it waits for
    assert ledger.waiting_for("dog") == ["r"] and ledger.waiting_for("owl") == ["r"]
    [ready_too] = admit_to(ledger, arrivals.add(image_request("s", ["owl"])))  # another request waits for owl
    assert ready_too.pending == {"owl"}
    assert ledger.waiting_for("owl") == ["r", "s"]
    assert hand_on(arrivals, ledger, "owl", "emb-owl") == []  # the engine took it
    assert ledger.waiting_for("owl") == [] and ledger.get("owl") == "emb-owl"  # "s" has all its images
    assert hand_on(arrivals, ledger, "dog", "emb-dog") == []
    assert ledger.waiting_for("dog") == [] and ledger.get("dog") == "emb-dog"
    assert arrivals._staged == {} and arrivals.find("dog") is None  # taken by the engine: not kept here


def test_early_a_failed_image_fails_the_admitted_request():
    arrivals, _, _ = make_arrivals(early=True)
    ledger = ImageLedger()
    admit_to(ledger, arrivals.add(image_request("r", ["cat", "dog"])))
    assert hand_on(arrivals, ledger, "cat", "emb-cat") == []
    failed = ledger.waiting_for("dog")  # as EngineCore.fail_image: these leave the engine and fail
    assert failed == ["r"]
    ledger.remove(failed)
    assert arrivals.failed("dog", "bad pixels", None) == []  # the worker passes None: "r" reached the engine
    assert "r" not in arrivals and ledger.waiting_for("dog") == []
    assert hand_on(arrivals, ledger, "dog", "emb-dog") == []  # nobody uses it any more:
    assert ledger.get("dog") is None and arrivals.find("dog") == "emb-dog"  # kept here for a request still to come
