"""The image ledger: an image is pending until it arrives, held while a
request in the engine uses it, and freed (at the next step) once the last
one leaves; the scheduler, sharing it, never computes past a pending image
and never preempts a request it could not compute again."""
from __future__ import annotations

import pytest

from epd.engine.image_ledger import ImageLedger
from epd.engine.scheduler import Scheduler
from epd.engine.scheduler_output import SchedulerOutput

from testkit.engine_factories import (ENTRY, add_request, assert_all_blocks_free, fake_run, image_request,
                                      make_image_prompt, make_request, make_scheduler)


def engine_step(scheduler: Scheduler) -> tuple[SchedulerOutput, list[str]]:
    """One step with the ledger calls `EngineCore.step` makes: (the output, the images freed before it).
    Every image a scheduled chunk covers is held when the runner would read it."""
    freed = scheduler.images.drop_unused()
    output = scheduler.schedule()
    assert all(scheduler.images.get(span.mm_hash) is ENTRY for s in output.scheduled for span, _, _ in s.mm_slices())
    updates = scheduler.update(output, fake_run(output))
    scheduler.images.remove(u.request_id for u in updates if u.is_finished)
    return output, freed


def run_until_done(scheduler: Scheduler) -> list[tuple[SchedulerOutput, list[str]]]:
    steps = []
    while scheduler.has_unfinished():
        steps.append(engine_step(scheduler))
        assert len(steps) < 1000
    return steps


def test_an_image_goes_pending_then_here_then_unused_then_freed():
    images = ImageLedger()
    request = image_request(["cat", "dog"])
    images.add(request, {"dog": ENTRY}, pending=["cat"])
    assert images.get("cat") is None and images.get("dog") is ENTRY and images.num_images == 2
    assert images.arrived("cat", ENTRY) and images.get("cat") is ENTRY
    assert not images.arrived("cat", object())  # here already: nothing changes
    assert images.get("cat") is ENTRY
    images.remove([request.request_id])
    assert images.get("cat") is ENTRY  # unused, held until the next step starts
    assert images.drop_unused() == ["cat", "dog"]  # in the order they became unused
    assert images.get("cat") is None and images.num_images == 0
    assert images.drop_unused() == []


def test_a_pending_image_nobody_uses_any_more_is_not_kept():
    images = ImageLedger()
    request = image_request(["cat"])
    images.add(request, pending=["cat"])
    images.remove([request.request_id])
    assert not images.arrived("cat", ENTRY)  # nobody waits for it any more
    assert images.get("cat") is None and images.drop_unused() == [] and images.num_images == 0


def test_add_refuses_an_image_it_cannot_account_for_and_a_second_add():
    images = ImageLedger()
    request = image_request(["cat", "dog"])
    with pytest.raises(ValueError, match=r"no embeddings for images \['dog'\]"):
        images.add(request, {"cat": ENTRY})
    assert images.num_images == 0  # nothing kept
    images.add(request, {"cat": ENTRY, "dog": ENTRY})
    with pytest.raises(ValueError, match="already"):
        images.add(request, {"cat": ENTRY, "dog": ENTRY})
    again = image_request(["dog"])
    assert images.missing(again) == []  # held for the first: the second needs none


def test_the_first_pending_image_bounds_the_prefill():
    images = ImageLedger()
    request = image_request(["cat", "dog"], num_text=6)  # cat at 6..10, dog at 12..16, 18 tokens
    images.add(request, {"cat": ENTRY}, pending=["dog"])
    assert images.prefill_bound(request) == 12
    assert images.prefill_bound(request, start=14) == 14  # inside dog: nothing more
    assert images.can_recompute(request)
    images.arrived("dog", ENTRY)
    assert images.prefill_bound(request) == 18
    unknown = image_request(["owl"])
    assert images.prefill_bound(unknown) == unknown.num_tokens  # only pending images bound
    assert not images.can_recompute(unknown)  # its embeddings are nowhere here


def test_an_image_is_freed_once_its_last_request_finishes():
    scheduler = make_scheduler()
    short = image_request(["cat"], max_tokens=1)
    long = image_request(["cat", "dog"], max_tokens=3)
    add_request(scheduler, short)
    add_request(scheduler, long)
    _, freed = engine_step(scheduler)
    assert freed == [] and short.is_finished
    _, freed = engine_step(scheduler)
    assert freed == []  # "cat" is still long's
    steps = run_until_done(scheduler)
    assert long.is_finished and steps[-1][0].scheduled[0].request is long
    assert all(freed == [] for _, freed in steps)
    # Freed by the step after the finish, once, in prompt order.
    assert engine_step(scheduler)[1] == ["cat", "dog"]
    assert engine_step(scheduler)[1] == []


def test_abort_frees_images_of_waiting_and_running_requests():
    scheduler = make_scheduler()
    running = image_request(["cat"], max_tokens=5)
    waiting = image_request(["dog"], max_tokens=5)
    add_request(scheduler, running)
    engine_step(scheduler)
    add_request(scheduler, waiting)
    aborted = scheduler.abort([running.request_id, waiting.request_id])
    assert sorted(aborted) == sorted([running.request_id, waiting.request_id])
    scheduler.images.remove(aborted)  # as EngineCore.abort
    output, freed = engine_step(scheduler)
    assert sorted(freed) == ["cat", "dog"]
    assert sorted(output.finished_request_ids) == sorted([running.request_id, waiting.request_id])
    assert_all_blocks_free(scheduler)


def test_a_prefilled_request_holds_its_images_until_release():
    scheduler = make_scheduler(role="prefill")
    request = image_request(["cat"], max_tokens=4)
    add_request(scheduler, request)
    _, freed = engine_step(scheduler)
    assert scheduler.num_prefilled == 1 and freed == []
    assert engine_step(scheduler)[1] == []  # its KV is still to be shipped
    scheduler.release(request.request_id)
    scheduler.images.remove([request.request_id])  # as EngineCore.release
    assert engine_step(scheduler)[1] == ["cat"]


def test_an_image_taken_again_before_the_step_is_not_freed():
    scheduler = make_scheduler()
    first = image_request(["cat"], max_tokens=1)
    add_request(scheduler, first)
    engine_step(scheduler)
    assert first.is_finished
    again = image_request(["cat"], max_tokens=1)
    assert scheduler.images.missing(again) == []  # still held: it needs no embeddings
    add_request(scheduler, again)  # before the step that would drop "cat"
    output, freed = engine_step(scheduler)
    assert freed == [] and output.scheduled[0].request is again
    assert engine_step(scheduler)[1] == ["cat"]


def test_preemption_keeps_images_and_no_step_uses_a_freed_one():
    """Under a block budget that preempts, a freed image is never scheduled
    again, and every image is freed exactly once, after its last user."""
    scheduler = make_scheduler(num_blocks=9, block_size=4, max_num_batched_tokens=6)
    requests = [image_request(["cat"], max_tokens=6), image_request(["dog", "cat"], max_tokens=4),
                image_request(["owl"], num_image_tokens=6, max_tokens=5)]
    for request in requests:
        add_request(scheduler, request)
    steps = run_until_done(scheduler)
    steps.append(engine_step(scheduler))
    assert scheduler.num_preemptions > 0
    freed: list[str] = []
    for output, freed_before in steps:
        freed += freed_before
        in_use = {h for s in output.scheduled for h in s.request.mm_hashes}
        assert not in_use & set(freed), "an image was scheduled after it was freed"
    assert sorted(freed) == ["cat", "dog", "owl"]
    assert_all_blocks_free(scheduler)


def test_a_decode_worker_keeps_no_images_for_its_prefilled_requests():
    scheduler = make_scheduler(role="decode")
    token_ids, span = make_image_prompt(2, 4, 2, mm_hash="cat")
    request = make_request(prompt_token_ids=token_ids, mm_spans=[span], max_tokens=2)
    request.output_token_ids.append(7)  # sampled by the prefill worker
    assert scheduler.add_prefilled(request) is not None
    assert not scheduler.images.can_recompute(request)  # its KV is all it has here
    run_until_done(scheduler)
    assert request.is_finished and scheduler.images.num_images == 0
    assert engine_step(scheduler)[1] == []


def test_waiting_for_names_the_requests_an_image_failure_fails():
    images = ImageLedger()
    a, b, c = image_request(["cat"]), image_request(["dog", "cat"]), image_request(["dog"])
    images.add(a, pending=["cat"])
    images.add(b, pending=["dog", "cat"])
    images.add(c, pending=["dog"])
    held = image_request(["owl"])
    images.add(held, {"owl": ENTRY})
    assert images.waiting_for("cat") == [a.request_id, b.request_id]  # in the order they entered
    assert images.waiting_for("dog") == [b.request_id, c.request_id]
    assert images.waiting_for("owl") == [] and images.waiting_for("emu") == []  # here; unknown
    images.remove(images.waiting_for("cat"))  # as EngineCore.fail_image
    assert images.waiting_for("dog") == [c.request_id]
    assert not images.arrived("cat", ENTRY)  # nobody uses it any more: not kept
    assert images.arrived("dog", ENTRY) and images.waiting_for("dog") == []  # here: nobody waits


def test_a_request_computed_past_a_pending_image_does_not_wait_for_it():
    """Its prefix-cache hit covered the image: it samples without it, so the
    image's failure or lateness is no longer its own."""
    scheduler = make_scheduler()  # block_size 4, prefix caching
    token_ids, span = make_image_prompt(2, 4, 10, mm_hash="cat")  # cat at 2..6 of 16 tokens
    first = make_request(prompt_token_ids=token_ids, mm_spans=[span], max_tokens=1)
    add_request(scheduler, first)
    run_until_done(scheduler)
    assert engine_step(scheduler)[1] == ["cat"]  # freed: the next request waits for it again
    again = make_request(prompt_token_ids=token_ids, mm_spans=[span], max_tokens=2)
    again.arrival_time = 0.0
    add_request(scheduler, again, pending=["cat"])
    assert scheduler.images.waiting_for("cat") == [again.request_id]
    assert scheduler.images.overdue(now_s=1000.0, max_wait_s=600.0) == [again.request_id]
    engine_step(scheduler)  # 12 tokens from the prefix cache, past cat: the rest is computed, one sampled
    assert again.num_cached_tokens == 12 and again.output_token_ids
    assert scheduler.images.waiting_for("cat") == []
    assert scheduler.images.overdue(now_s=1000.0, max_wait_s=600.0) == []
    assert scheduler.images.can_recompute(again)  # still pending: preempted, it would wait again


def test_overdue_names_the_requests_still_waiting_past_the_deadline():
    images = ImageLedger()
    old, new, here = image_request(["cat"]), image_request(["cat", "dog"]), image_request(["owl"])
    old.arrival_time, new.arrival_time, here.arrival_time = 100.0, 150.0, 0.0
    images.add(old, pending=["cat"])
    images.add(new, pending=["cat", "dog"])
    images.add(here, {"owl": ENTRY})  # all its images here: never overdue
    assert images.overdue(now_s=160.0, max_wait_s=60.0) == []
    assert images.overdue(now_s=161.0, max_wait_s=60.0) == [old.request_id]
    assert images.overdue(now_s=10_000.0, max_wait_s=60.0) == [old.request_id, new.request_id]
    images.arrived("cat", ENTRY)
    assert images.overdue(now_s=10_000.0, max_wait_s=60.0) == [new.request_id]  # still waits for dog
    images.arrived("dog", ENTRY)
    assert images.overdue(now_s=10_000.0, max_wait_s=60.0) == []
