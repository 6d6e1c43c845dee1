"""Scheduler: budgets, chunked prefill, preemption, stop rules, roles."""
from __future__ import annotations

import pytest

from epd.engine.request import Request, RequestStatus

from testkit.engine_factories import (EOS_ID, assert_all_blocks_free, expected_outputs, fake_run, fake_token,
                                      make_image_prompt, make_request, make_scheduler,
                                      run_until_done)


def step(scheduler, model=fake_token):
    output = scheduler.schedule()
    return output, scheduler.update(output, fake_run(output, model))


def scripted(tokens_by_id: dict[str, list[int]]):
    """A fake model that emits a fixed token list per request."""
    return lambda request: tokens_by_id[request.request_id][request.num_output_tokens]


def test_single_request_prefills_then_decodes_to_length():
    scheduler = make_scheduler()
    request = make_request(10, max_tokens=4)
    scheduler.add_request(request)
    output, updates = step(scheduler)
    [chunk] = output.scheduled
    assert (chunk.start, chunk.num_new_tokens, chunk.is_last_chunk) == (0, 10, True)
    assert output.num_batched_tokens == 10
    assert updates[0].new_token_ids == [10_010] and not updates[0].is_finished
    assert request.num_computed_tokens == 10 and request.status is RequestStatus.RUNNING

    outputs = run_until_done(scheduler)
    assert [o.scheduled[0].num_new_tokens for o in outputs] == [1, 1, 1]
    assert request.output_token_ids == expected_outputs(10, 4)
    assert request.status is RequestStatus.FINISHED_LENGTH
    assert outputs[-1].scheduled[0].request_id == request.request_id
    assert scheduler.schedule().finished_request_ids == [request.request_id]
    assert_all_blocks_free(scheduler)


def test_chunked_prefill_splits_long_prompt_across_steps():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = make_request(20, max_tokens=2)
    scheduler.add_request(request)
    chunks = []
    for _ in range(3):
        output, updates = step(scheduler)
        [chunk] = output.scheduled
        chunks.append((chunk.start, chunk.num_new_tokens, chunk.is_last_chunk))
        assert chunk.token_ids == request.prompt_token_ids[chunk.start:chunk.end]
        assert bool(updates) == chunk.is_last_chunk  # only the last chunk samples
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]
    run_until_done(scheduler)
    assert request.output_token_ids == expected_outputs(20, 2)
    assert_all_blocks_free(scheduler)


def test_chunk_boundary_may_fall_inside_an_image_span():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    token_ids, span = make_image_prompt(3, 10, 2, mm_hash="cat")  # image at [3, 13)
    request = make_request(prompt_token_ids=token_ids, mm_spans=[span], max_tokens=1)
    scheduler.add_request(request)
    first, _ = step(scheduler)
    second, updates = step(scheduler)
    assert first.scheduled[0].mm_slices() == [(span, 0, 5)]  # rows 0..4 of the image
    assert second.scheduled[0].mm_slices() == [(span, 5, 10)]
    assert (second.scheduled[0].start, second.scheduled[0].num_new_tokens) == (8, 7)
    assert updates[0].finish_reason == "length"
    assert_all_blocks_free(scheduler)


def test_decodes_are_scheduled_before_prefills():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    decoding = make_request(3, max_tokens=5)
    scheduler.add_request(decoding)
    step(scheduler)
    long_prompt = make_request(30, max_tokens=1)
    scheduler.add_request(long_prompt)
    output, _ = step(scheduler)
    assert [(s.request_id, s.num_new_tokens) for s in output.scheduled] == \
        [(decoding.request_id, 1), (long_prompt.request_id, 7)]

    # Even a mid-prefill request that arrived earlier yields to a decode.
    scheduler = make_scheduler(max_num_batched_tokens=8)
    early = make_request(30, max_tokens=1)
    early.arrival_time = 1.0
    scheduler.add_request(early)
    step(scheduler)  # early: tokens [0, 8)
    late = make_request(6, max_tokens=3)
    late.arrival_time = 2.0
    late.output_token_ids.append(10_006)
    assert scheduler.add_prefilled(late) is not None
    output, _ = step(scheduler)
    assert [(s.request_id, s.start, s.num_new_tokens) for s in output.scheduled] == \
        [(late.request_id, 6, 1), (early.request_id, 8, 7)]
    run_until_done(scheduler)
    assert late.output_token_ids == expected_outputs(6, 3)
    assert_all_blocks_free(scheduler)


def test_max_num_seqs_caps_running_requests_fcfs():
    scheduler = make_scheduler(max_num_seqs=2)
    requests = [make_request(5, max_tokens=3) for _ in range(4)]
    for request in requests:
        scheduler.add_request(request)
    finish_order = []
    while scheduler.has_unfinished():
        output, updates = step(scheduler)
        assert len(output.scheduled) <= 2 and scheduler.num_running <= 2
        finish_order += [u.request_id for u in updates if u.is_finished]
    assert finish_order == [r.request_id for r in requests]
    assert all(r.output_token_ids == expected_outputs(5, 3) for r in requests)
    assert_all_blocks_free(scheduler)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_preemption_under_tiny_block_budget_keeps_outputs_exact(enable_prefix_caching):
    # 6 blocks x 4 = 24 token slots; three requests of 6 + 10 tokens need 45.
    scheduler = make_scheduler(num_blocks=6, enable_prefix_caching=enable_prefix_caching)
    requests = [make_request(prompt_token_ids=[i * 100 + t for t in range(6)], max_tokens=10)
                for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    outputs = run_until_done(scheduler)

    assert scheduler.num_preemptions > 0
    assert sum(r.num_preemptions for r in requests) == scheduler.num_preemptions
    for request in requests:
        assert request.status is RequestStatus.FINISHED_LENGTH
        assert request.output_token_ids == expected_outputs(6, 10)
    # The newest arrival is the first victim, and it goes to the front of waiting.
    first = next(o for o in outputs if o.preempted_request_ids)
    assert first.preempted_request_ids[0] == requests[2].request_id
    assert_all_blocks_free(scheduler)
    assert scheduler.stats()["num_preemptions"] == scheduler.num_preemptions


def test_preempted_request_recomputes_prompt_and_outputs():
    scheduler = make_scheduler(num_blocks=4, max_num_seqs=2, enable_prefix_caching=False)
    old, new, later = (make_request(6, max_tokens=8) for _ in range(3))
    for request in (old, new, later):
        scheduler.add_request(request)
    preempting = None
    while preempting is None:
        output, _ = step(scheduler)
        if output.preempted_request_ids:
            preempting = output
    assert preempting.preempted_request_ids == [new.request_id]
    assert new.status is RequestStatus.PREEMPTED and new.block_ids == []
    assert new.num_computed_tokens == 0
    assert list(scheduler.waiting) == [new, later]  # back to the FRONT of the queue
    tokens_before = list(new.output_token_ids)
    assert tokens_before  # it had decoded before losing its KV

    while new.status is not RequestStatus.RUNNING:
        output, _ = step(scheduler)
    [chunk] = [s for s in output.scheduled if s.request_id == new.request_id]
    assert (chunk.start, chunk.num_new_tokens) == (0, 6 + len(tokens_before))
    assert chunk.is_last_chunk  # sampling resumes right after the recompute
    run_until_done(scheduler)
    assert new.output_token_ids == expected_outputs(6, 8)
    assert new.output_token_ids[:len(tokens_before)] == tokens_before
    assert later.output_token_ids == expected_outputs(6, 8)
    assert_all_blocks_free(scheduler)


def test_prefix_cache_hit_skips_cached_tokens_and_shares_blocks():
    scheduler = make_scheduler()
    first = make_request(prompt_token_ids=list(range(100, 110)), max_tokens=3)
    scheduler.add_request(first)
    step(scheduler)
    second = make_request(prompt_token_ids=list(range(100, 108)) + [7, 7, 7], max_tokens=3)
    scheduler.add_request(second)
    output, _ = step(scheduler)
    chunk = output.scheduled[-1]
    assert chunk.request_id == second.request_id
    assert (chunk.start, chunk.num_new_tokens) == (8, 3)
    assert second.num_cached_tokens == 8
    assert second.block_ids[:2] == first.block_ids[:2]
    assert all(scheduler.block_manager.ref_count(b) == 2 for b in first.block_ids[:2])
    stats = scheduler.stats()
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (21, 8)
    run_until_done(scheduler)
    assert second.output_token_ids == expected_outputs(11, 3)
    assert_all_blocks_free(scheduler)


@pytest.mark.parametrize("params, script, reason, num_kept", [
    ({}, [5, 6, EOS_ID, 8], "stop", 3),
    ({"ignore_eos": True}, [5, 6, EOS_ID, 8, 9, 10], "length", 6),
    ({"stop_token_ids": [77]}, [5, 77, 8], "stop", 2),
    ({"min_tokens": 3}, [EOS_ID, 77, EOS_ID, 9], "stop", 3),
    ({"min_tokens": 3, "stop_token_ids": [77]}, [77, 5, 6, 77, 8], "stop", 4),
    ({}, [5, 6, 7, 8, 9, 10], "length", 6),
])
def test_stop_rules(params, script, reason, num_kept):
    scheduler = make_scheduler()
    request = make_request(4, eos_token_ids=[EOS_ID], max_tokens=6, **params)
    scheduler.add_request(request)
    updates = []
    while scheduler.has_unfinished():
        updates += step(scheduler, scripted({request.request_id: script}))[1]
    assert request.output_token_ids == script[:num_kept]
    assert updates[-1].finish_reason == reason and updates[-1].is_finished
    assert [u.is_finished for u in updates[:-1]] == [False] * (num_kept - 1)
    expected = RequestStatus.FINISHED_STOPPED if reason == "stop" else RequestStatus.FINISHED_LENGTH
    assert request.status is expected
    assert_all_blocks_free(scheduler)


def test_max_model_len_ends_a_request_with_length():
    scheduler = make_scheduler(max_model_len=12)
    request = make_request(8, max_tokens=None)
    scheduler.add_request(request)
    run_until_done(scheduler)
    assert request.num_tokens == 12 and request.status is RequestStatus.FINISHED_LENGTH
    assert_all_blocks_free(scheduler)

    # The KV cache bounds the length too: a longer sequence could never run again.
    scheduler = make_scheduler(num_blocks=3)  # 12 token slots
    request = make_request(8, max_tokens=None)
    request.max_model_len = 1000
    scheduler.add_request(request)
    run_until_done(scheduler)
    assert request.num_tokens == 12 and request.status is RequestStatus.FINISHED_LENGTH
    assert_all_blocks_free(scheduler)


def test_abort_in_waiting_running_and_between_schedule_and_update():
    scheduler = make_scheduler(max_num_seqs=1)
    running, waiting, racing = (make_request(5, max_tokens=8) for _ in range(3))
    for request in (running, waiting, racing):
        scheduler.add_request(request)
    step(scheduler)
    assert running.block_ids and not waiting.block_ids
    assert scheduler.abort([waiting.request_id, running.request_id, "unknown"]) == \
        [waiting.request_id, running.request_id]
    assert waiting.status is running.status is RequestStatus.FINISHED_ABORTED
    assert scheduler.num_running == 0 and scheduler.num_waiting == 1
    assert running.block_ids == []

    output = scheduler.schedule()
    assert [s.request_id for s in output.scheduled] == [racing.request_id]
    assert set(output.finished_request_ids) == {waiting.request_id, running.request_id}
    scheduler.abort([racing.request_id])
    assert scheduler.update(output, fake_run(output)) == []  # aborted meanwhile: skipped
    assert racing.output_token_ids == [] and not scheduler.has_unfinished()
    assert_all_blocks_free(scheduler)


def test_update_requires_a_token_for_every_sampling_chunk():
    scheduler = make_scheduler()
    scheduler.add_request(make_request(4))
    output = scheduler.schedule()
    assert output.sampling_request_ids == [output.scheduled[0].request_id]
    with pytest.raises(ValueError, match="no sampled token"):
        scheduler.update(output, {})


def test_prefill_role_holds_blocks_until_release():
    scheduler = make_scheduler(role="prefill", max_num_batched_tokens=8)
    request = make_request(10, max_tokens=5)
    scheduler.add_request(request)
    step(scheduler)  # tokens [0, 8), no sample
    output, updates = step(scheduler)
    assert updates[0].is_prefilled and updates[0].new_token_ids == [10_010]
    assert not updates[0].is_finished
    assert scheduler.num_running == 0 and scheduler.num_prefilled == 1
    assert not scheduler.has_unfinished()
    assert request.num_computed_tokens == 10 and len(request.block_ids) == 3
    assert scheduler.block_manager.num_free_blocks == 64 - 3
    assert scheduler.schedule().is_empty  # prefilled requests are not stepped

    scheduler.release(request.request_id)
    assert_all_blocks_free(scheduler)
    with pytest.raises(ValueError, match="not held as prefilled"):
        scheduler.release(request.request_id)


def test_prefill_role_finishes_a_request_that_stops_on_its_first_token():
    scheduler = make_scheduler(role="prefill")
    stopped = make_request(6, max_tokens=1)
    held = make_request(6, max_tokens=4)
    scheduler.add_request(stopped)
    scheduler.add_request(held)
    _, updates = step(scheduler)
    assert [(u.finish_reason, u.is_prefilled) for u in updates] == [("length", False),
                                                                     (None, True)]
    assert scheduler.abort([held.request_id]) == [held.request_id]  # abort while held
    assert scheduler.num_prefilled == 0
    assert_all_blocks_free(scheduler)


def test_decode_role_takes_prefilled_requests():
    with pytest.raises(ValueError, match="add_prefilled"):  # local prefill off: prompts are refused
        make_scheduler(role="decode", max_local_prefill_tokens=0).add_request(make_request(4))
    scheduler = make_scheduler(num_blocks=5, role="decode")
    request = make_request(10, max_tokens=4)
    request.output_token_ids.append(10_010)  # sampled by the prefill worker
    block_ids = scheduler.add_prefilled(request)
    assert block_ids == request.block_ids and len(block_ids) == 3
    assert request.num_computed_tokens == 10 and scheduler.num_running == 1

    no_room = make_request(10, max_tokens=4)
    no_room.output_token_ids.append(1)
    assert scheduler.add_prefilled(no_room) is None  # 2 free blocks, needs 3
    assert no_room.block_ids == [] and scheduler.num_running == 1

    output, _ = step(scheduler)
    [chunk] = output.scheduled
    assert (chunk.start, chunk.num_new_tokens, chunk.is_last_chunk) == (10, 1, True)
    run_until_done(scheduler)
    assert request.output_token_ids == expected_outputs(10, 4)
    assert_all_blocks_free(scheduler)
    assert scheduler.add_prefilled(no_room) is not None  # room now


def test_decode_role_prefills_local_prompts_in_bounded_chunks_beside_its_decodes():
    """Conditional disaggregation: a decode worker takes prefilled requests and
    short prompts; its decodes run every step and each step computes at most
    max_local_prefill_tokens prompt tokens, whatever the batch budget."""
    scheduler = make_scheduler(role="decode", max_num_batched_tokens=64, max_local_prefill_tokens=8)
    prefilled = make_request(10, max_tokens=6)
    prefilled.output_token_ids.append(10_010)  # sampled by the prefill worker
    assert scheduler.add_prefilled(prefilled) is not None
    local = make_request(20, max_tokens=3)
    scheduler.add_request(local)

    chunks = []
    while local.num_output_tokens == 0:
        output, _ = step(scheduler)
        assert prefilled.request_id in output.sampling_request_ids  # the decode never waits a step
        chunks.append(next(s.num_new_tokens for s in output.scheduled if s.request is local))
        assert output.num_batched_tokens <= 1 + 8
    assert chunks == [8, 8, 4]
    run_until_done(scheduler)
    assert local.output_token_ids == expected_outputs(20, 3)
    assert prefilled.output_token_ids == [10_010] + expected_outputs(11, 5)
    assert_all_blocks_free(scheduler)


def test_only_the_decode_role_bounds_its_prefill_chunks():
    for role in ("pd", "prefill"):
        scheduler = make_scheduler(role=role, max_num_batched_tokens=64, max_local_prefill_tokens=8)
        scheduler.add_request(make_request(20))
        assert scheduler.schedule().num_batched_tokens == 20


@pytest.mark.parametrize("num_steps", [1, 4])  # mid-prefill, then while decoding
def test_aborting_a_local_prefill_frees_its_blocks(num_steps):
    scheduler = make_scheduler(role="decode", max_local_prefill_tokens=8)
    local = make_request(20, max_tokens=8)
    scheduler.add_request(local)
    for _ in range(num_steps):
        step(scheduler)
    assert local.block_ids and (local.num_output_tokens > 0) == (num_steps > 3)
    assert scheduler.abort([local.request_id]) == [local.request_id]
    assert local.status is RequestStatus.FINISHED_ABORTED and not scheduler.has_unfinished()
    assert_all_blocks_free(scheduler)


def test_prefill_and_decode_roles_match_a_combined_run():
    prompt = list(range(300, 317))
    combined = make_scheduler(max_num_batched_tokens=8)
    reference = make_request(prompt_token_ids=prompt, max_tokens=6)
    combined.add_request(reference)
    run_until_done(combined)

    prefill = make_scheduler(role="prefill", max_num_batched_tokens=8)
    decode = make_scheduler(role="decode")
    sent = make_request(prompt_token_ids=prompt, max_tokens=6)
    prefill.add_request(sent)
    while not prefill.num_prefilled:
        step(prefill)
    received = Request(request_id=sent.request_id, prompt_token_ids=list(prompt),
                       sampling_params=sent.sampling_params,
                       output_token_ids=list(sent.output_token_ids))
    assert len(decode.add_prefilled(received)) == len(sent.block_ids)
    prefill.release(sent.request_id)
    run_until_done(decode)
    assert received.output_token_ids == reference.output_token_ids
    assert_all_blocks_free(prefill)
    assert_all_blocks_free(decode)


def test_refuses_prompts_that_cannot_fit():
    scheduler = make_scheduler(num_blocks=4)  # 16 token slots
    with pytest.raises(ValueError, match="cannot fit in the KV cache"):
        scheduler.add_request(make_request(17))
    with pytest.raises(ValueError, match="max_model_len"):
        make_scheduler(max_model_len=10).add_request(make_request(10))
    with pytest.raises(ValueError, match="duplicate"):
        request = make_request(4)
        scheduler.add_request(request)
        scheduler.add_request(request)
    assert scheduler.num_waiting == 1

    # A prompt that fills the whole cache still runs, alone, and stops on length.
    full = make_request(16, max_tokens=5)
    scheduler.abort([request.request_id])
    scheduler.add_request(full)
    run_until_done(scheduler)
    assert full.status is RequestStatus.FINISHED_LENGTH and full.num_output_tokens == 1
    assert_all_blocks_free(scheduler)


def test_stats_report_queues_and_cache():
    scheduler = make_scheduler(num_blocks=10, max_num_seqs=1)
    scheduler.add_request(make_request(8))
    scheduler.add_request(make_request(8))
    step(scheduler)
    stats = scheduler.stats()
    assert stats["num_running"] == 1 and stats["num_waiting"] == 1
    assert stats["num_free_blocks"] == 8  # 8 prompt tokens in 2 blocks
    assert stats["kv_usage"] == pytest.approx(0.2)
    run_until_done(scheduler)
    assert scheduler.stats()["kv_usage"] == 0.0
    assert_all_blocks_free(scheduler)
