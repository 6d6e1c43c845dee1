"""Scheduler: prefill that starts before every image is here (a request is
never computed past a missing image's first placeholder), the bound on
requests that hold blocks while waiting, and prefill priority by cost with
bounded aging."""
from __future__ import annotations

from epd.transport.wire.mm_span import MMSpan

from testkit.engine_factories import (ENTRY, IMAGE_PAD_ID, add_request, assert_all_blocks_free, image_request,
                                      make_request, make_scheduler, run_until_done, step)


def two_image_request(num_text: int = 6, num_image_tokens: int = 4, **kwargs):
    """text(num_text) + cat + 2 text + dog + 2 text."""
    return image_request(["cat", "dog"], num_image_tokens, num_text, **kwargs)


def computed_by_step(scheduler, request, num_steps):
    for _ in range(num_steps):
        step(scheduler)
    return request.num_computed_tokens


def test_a_request_is_prefilled_up_to_its_first_missing_image_then_on_as_images_arrive():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    request = two_image_request()  # cat at 6..10, dog at 12..16, 18 tokens
    add_request(scheduler, request, pending=["cat", "dog"])
    assert computed_by_step(scheduler, request, 5) == 6  # chunks 4 + 2, then blocked at cat
    assert not scheduler.has_unfinished() and scheduler.num_waiting_for_images == 1
    assert scheduler.schedule().scheduled == []
    # dog first (out of order): still blocked at cat
    assert scheduler.images.arrived("dog", ENTRY) and not scheduler.has_unfinished()
    assert scheduler.schedule().scheduled == []
    assert scheduler.images.arrived("cat", ENTRY) and scheduler.has_unfinished()
    outputs = run_until_done(scheduler)
    assert request.is_finished and request.num_output_tokens == 4
    chunks = [(s.start, s.end) for o in outputs for s in o.scheduled if s.start < 18]
    assert chunks[0] == (6, 10)  # resumed exactly where it stopped
    assert not scheduler.images.arrived("cat", ENTRY)  # nobody waits for it any more
    assert_all_blocks_free(scheduler)


def test_no_chunk_ever_covers_a_missing_image():
    scheduler = make_scheduler(max_num_batched_tokens=5)
    request = two_image_request()
    add_request(scheduler, request, pending=["cat", "dog"])
    arrivals = {3: "cat", 6: "dog"}  # step -> image that arrives before it
    here: set[str] = set()
    for i in range(40):
        if i in arrivals:
            scheduler.images.arrived(arrivals[i], ENTRY)
            here.add(arrivals[i])
        output, _ = step(scheduler)
        for s in output.scheduled:
            assert {span.mm_hash for span, _, _ in s.mm_slices()} <= here
        if request.is_finished:
            break
    assert request.is_finished


def test_a_blocked_request_yields_its_budget_and_does_not_block_the_queue():
    scheduler = make_scheduler(max_num_batched_tokens=8, prefill_priority="fcfs")
    blocked = two_image_request()
    image_first = make_request(prompt_token_ids=[IMAGE_PAD_ID] * 4 + [7, 8],
                               mm_spans=[MMSpan(0, 4, "fox", {"grid_thw": (1, 2, 8)})])
    text = make_request(12)
    add_request(scheduler, blocked, pending=["cat"])
    add_request(scheduler, image_first, pending=["fox"])  # cannot even start
    scheduler.add_request(text)
    output, _ = step(scheduler)
    assert [(s.request_id, s.num_new_tokens) for s in output.scheduled] == [
        (blocked.request_id, 6), (text.request_id, 2)]
    output, _ = step(scheduler)
    assert [(s.request_id, s.num_new_tokens) for s in output.scheduled] == [(text.request_id, 8)]
    assert image_first.block_ids == [] and image_first in scheduler.waiting


def test_at_most_max_num_image_waits_requests_hold_blocks_waiting_for_images():
    scheduler = make_scheduler(max_num_image_waits=2)
    waiting = [two_image_request() for _ in range(4)]
    for request in waiting:
        add_request(scheduler, request, pending=["cat"])
    step(scheduler)
    assert [r.num_computed_tokens for r in waiting] == [6, 6, 0, 0]
    assert [bool(r.block_ids) for r in waiting] == [True, True, False, False]
    scheduler.images.arrived("cat", ENTRY)
    run_until_done(scheduler)
    assert all(r.is_finished for r in waiting)
    assert_all_blocks_free(scheduler)


def test_a_request_that_will_wait_starts_only_when_its_whole_prompt_fits():
    scheduler = make_scheduler(num_blocks=6)  # 24 tokens
    holder = make_request(12, max_tokens=8)  # 3 blocks for its prompt
    scheduler.add_request(holder)
    step(scheduler)
    partial = two_image_request()  # 18 tokens: 5 blocks; 6 before cat would need 2
    add_request(scheduler, partial, pending=["cat"])
    step(scheduler)
    assert partial.num_computed_tokens == 0 and partial.block_ids == []
    while not holder.is_finished:
        step(scheduler)
    step(scheduler)
    assert partial.num_computed_tokens == 6


def test_waiting_requests_cannot_deadlock_the_cache():
    """Four requests fill a small cache up to their missing images; when the
    images arrive, the earliest preempts later ones and every request finishes."""
    scheduler = make_scheduler(num_blocks=10, max_num_image_waits=4)  # 40 tokens
    requests = [two_image_request(num_text=7) for _ in range(4)]  # 19 tokens, 8 before dog
    for request in requests:
        add_request(scheduler, request, pending=["dog"])
    for _ in range(4):
        step(scheduler)
    assert sum(r.num_computed_tokens for r in requests) > 0
    scheduler.images.arrived("dog", ENTRY)
    run_until_done(scheduler)
    assert all(r.is_finished and r.num_output_tokens == 4 for r in requests)
    assert_all_blocks_free(scheduler)


def test_a_request_waiting_for_an_image_is_preempted_for_an_earlier_one():
    scheduler = make_scheduler(num_blocks=6)  # 24 tokens
    first = make_request(4, max_tokens=18)  # grows to 22 tokens: KV of 21 needs all 6 blocks
    blocked = two_image_request(num_text=3)  # 15 tokens, stops at 3
    scheduler.add_request(first)
    add_request(scheduler, blocked, pending=["cat"])
    step(scheduler)
    assert blocked.num_computed_tokens == 3 and len(blocked.block_ids) == 1
    while not first.is_finished:
        step(scheduler)
    assert first.num_output_tokens == 18
    assert blocked.num_preemptions == 1 and blocked in scheduler.waiting
    scheduler.images.arrived("cat", ENTRY)
    run_until_done(scheduler)
    assert blocked.is_finished
    assert_all_blocks_free(scheduler)


def test_prefix_hashes_stay_correct_when_a_request_stops_mid_block():
    scheduler = make_scheduler(block_size=4)
    request = two_image_request(num_text=6)  # stops at 6: block 1 half full
    add_request(scheduler, request, pending=["cat"])
    step(scheduler)
    assert request.num_computed_tokens == 6
    same_text = two_image_request(num_text=6)
    other_image = make_request(prompt_token_ids=same_text.prompt_token_ids,
                               mm_spans=[MMSpan(s.offset, s.length, s.mm_hash + "-other", s.meta)
                                         for s in same_text.mm_spans])
    blocks, num_cached = scheduler.block_manager.get_computed_blocks(other_image)
    assert num_cached == 4  # only the full text block; the half-filled one is not cached
    scheduler.images.arrived("cat", ENTRY)
    run_until_done(scheduler)
    # Once computed with cat, the same prompt hits through the image; another image does not.
    blocks, num_cached = scheduler.block_manager.get_computed_blocks(same_text)
    assert num_cached == 16
    blocks, num_cached = scheduler.block_manager.get_computed_blocks(other_image)
    assert num_cached == 4


def test_cost_priority_lets_a_short_prefill_pass_a_long_one():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    long = make_request(40)
    scheduler.add_request(long)
    step(scheduler)  # 16 of 40
    short = make_request(prompt_token_ids=range(2000, 2010))  # shares no prefix with long
    scheduler.add_request(short)
    output, updates = step(scheduler)
    assert [(s.request_id, s.num_new_tokens) for s in output.scheduled] == [
        (short.request_id, 10), (long.request_id, 6)]
    assert [u.request_id for u in updates] == [short.request_id]

    fcfs = make_scheduler(max_num_batched_tokens=16, prefill_priority="fcfs")
    long, short = make_request(40), make_request(prompt_token_ids=range(2000, 2010))
    fcfs.add_request(long)
    step(fcfs)
    fcfs.add_request(short)
    output, _ = step(fcfs)
    assert [(s.request_id, s.num_new_tokens) for s in output.scheduled] == [(long.request_id, 16)]


def test_decodes_go_first_under_cost_priority():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    decoding = make_request(4, max_tokens=10)
    scheduler.add_request(decoding)
    step(scheduler)
    scheduler.add_request(make_request(3))
    output, _ = step(scheduler)
    assert output.scheduled[0].request is decoding and output.scheduled[0].num_new_tokens == 1


def test_aging_bounds_how_long_short_prefills_overtake_a_long_one():
    """A stream of short requests passes a long one only while they arrive
    within cost(long) / aging scheduled tokens after it."""
    aging, budget = 0.5, 8
    scheduler = make_scheduler(max_num_batched_tokens=budget, prefill_aging=aging, num_blocks=512)
    scheduler.add_request(make_request(budget))  # keeps the first step busy
    step(scheduler)
    long = make_request(40)
    scheduler.add_request(long)
    arrival_work = scheduler.num_scheduled_tokens
    started_at = None
    for i in range(200):  # one step's budget each, no shared prefix
        scheduler.add_request(make_request(prompt_token_ids=range(3000 + budget * i, 3000 + budget * (i + 1)),
                                           max_tokens=1))
        output, _ = step(scheduler)
        if long.request_id in {s.request_id for s in output.scheduled}:
            started_at = scheduler.num_scheduled_tokens - output.num_batched_tokens
            break
    assert started_at is not None, "the long request starved"
    work_before_it = started_at - arrival_work
    # Short i arrives 8 i tokens of work after it: passes it while 8 + 0.5 x 8 i < 40, i < 8.
    assert work_before_it == 8 * budget
    assert work_before_it <= 40 / aging  # the bound

    fcfs = make_scheduler(max_num_batched_tokens=budget, prefill_priority="fcfs", num_blocks=512)
    fcfs.add_request(make_request(budget))
    step(fcfs)
    long = make_request(40)
    fcfs.add_request(long)
    fcfs.add_request(make_request(prompt_token_ids=range(3000, 3000 + budget), max_tokens=1))
    output, _ = step(fcfs)
    assert output.scheduled[-1].request is long


def test_a_short_prefill_never_takes_the_blocks_a_running_one_needs_next():
    """Cost order puts a short new prompt first, but admitting it would leave
    the long prompt's next chunk no block (it would preempt itself): it waits."""
    scheduler = make_scheduler(num_blocks=7, max_num_batched_tokens=16)  # 28 tokens
    long = make_request(28)
    scheduler.add_request(long)
    step(scheduler)  # 16 tokens: 4 blocks, 3 free
    short = make_request(prompt_token_ids=range(2000, 2008))  # 2 blocks; cost 8 < 12 left of long
    scheduler.add_request(short)
    output, _ = step(scheduler)
    assert [(s.request_id, s.num_new_tokens) for s in output.scheduled] == [(long.request_id, 12)]
    assert output.preempted_request_ids == [] and short in scheduler.waiting
    run_until_done(scheduler)
    assert long.is_finished and short.is_finished and scheduler.num_preemptions == 0
