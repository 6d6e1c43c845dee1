"""Scheduler: how long an image's embeddings live (`SchedulerOutput.freed_mm_hashes`)."""
from __future__ import annotations

from testkit.engine_factories import (assert_all_blocks_free, image_request, make_image_prompt, make_request,
                                    make_scheduler, run_until_done, step)


def test_an_image_is_freed_once_its_last_request_finishes():
    scheduler = make_scheduler()
    short = image_request(["cat"], max_tokens=1)
    long = image_request(["cat", "dog"], max_tokens=3)
    scheduler.add_request(short)
    scheduler.add_request(long)
    output, updates = step(scheduler)
    assert output.freed_mm_hashes == []
    assert [u.request_id for u in updates if u.is_finished] == [short.request_id]
    output, _ = step(scheduler)
    assert output.freed_mm_hashes == []  # "cat" is still long's
    outputs = run_until_done(scheduler)
    assert long.is_finished and outputs[-1].scheduled[0].request is long
    assert all(o.freed_mm_hashes == [] for o in outputs)
    # Reported by the schedule() after the finish, once, in prompt order.
    assert scheduler.schedule().freed_mm_hashes == ["cat", "dog"]
    assert scheduler.schedule().freed_mm_hashes == []


def test_abort_frees_images_of_waiting_and_running_requests():
    scheduler = make_scheduler()
    running = image_request(["cat"], max_tokens=5)
    waiting = image_request(["dog"], max_tokens=5)
    scheduler.add_request(running)
    step(scheduler)
    scheduler.add_request(waiting)
    assert sorted(scheduler.abort([running.request_id, waiting.request_id])) == sorted(
        [running.request_id, waiting.request_id])
    output = scheduler.schedule()
    assert sorted(output.freed_mm_hashes) == ["cat", "dog"]
    assert sorted(output.finished_request_ids) == sorted([running.request_id, waiting.request_id])
    assert_all_blocks_free(scheduler)


def test_a_prefilled_request_holds_its_images_until_release():
    scheduler = make_scheduler(role="prefill")
    request = image_request(["cat"], max_tokens=4)
    scheduler.add_request(request)
    _, [update] = step(scheduler)
    assert update.is_prefilled
    assert scheduler.schedule().freed_mm_hashes == []  # its KV is still to be shipped
    scheduler.release(request.request_id)
    assert scheduler.schedule().freed_mm_hashes == ["cat"]


def test_an_image_taken_again_before_the_step_is_not_freed():
    scheduler = make_scheduler()
    first = image_request(["cat"], max_tokens=1)
    scheduler.add_request(first)
    step(scheduler)
    assert first.is_finished
    again = image_request(["cat"], max_tokens=1)
    scheduler.add_request(again)  # before the runner was told to drop "cat"
    output, _ = step(scheduler)
    assert output.freed_mm_hashes == [] and output.scheduled[0].request is again
    assert scheduler.schedule().freed_mm_hashes == ["cat"]


def test_preemption_keeps_images_and_no_step_uses_a_freed_one():
    """Under a block budget that preempts, a freed image is never scheduled in
    the same step, and every image is freed exactly once, after its last user."""
    scheduler = make_scheduler(num_blocks=9, block_size=4, max_num_batched_tokens=6)
    requests = [image_request(["cat"], max_tokens=6), image_request(["dog", "cat"], max_tokens=4),
                image_request(["owl"], num_image_tokens=6, max_tokens=5)]
    for request in requests:
        scheduler.add_request(request)
    outputs = run_until_done(scheduler)
    outputs.append(scheduler.schedule())
    assert scheduler.num_preemptions > 0
    freed: list[str] = []
    for output in outputs:
        in_use = {h for s in output.scheduled for h in s.request.mm_hashes}
        assert not in_use & set(output.freed_mm_hashes)
        assert not in_use & set(freed), "an image was scheduled after it was freed"
        freed += output.freed_mm_hashes
    assert sorted(freed) == ["cat", "dog", "owl"]
    assert_all_blocks_free(scheduler)


def test_a_decode_worker_frees_the_images_of_its_prefilled_requests():
    scheduler = make_scheduler(role="decode")
    token_ids, span = make_image_prompt(2, 4, 2, mm_hash="cat")
    request = make_request(prompt_token_ids=token_ids, mm_spans=[span], max_tokens=2)
    request.output_token_ids.append(7)  # sampled by the prefill worker
    assert scheduler.add_prefilled(request) is not None
    run_until_done(scheduler)
    assert scheduler.schedule().freed_mm_hashes == ["cat"]
