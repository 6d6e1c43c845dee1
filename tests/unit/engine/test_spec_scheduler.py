"""Speculative decoding in the scheduler and block manager, with the fake model
(the next token is 10_000 + the token count): a decode verifies its draft in
one step, takes the accepted prefix and one more token, counts only those as
computed, hands back the blocks of rejected tokens, and gives prefix-cache
hashes to accepted tokens only; drafts never make anyone preempt, fit the
token budget beside a chunked prefill, and stop where the request stops."""
from __future__ import annotations

from testkit.engine_factories import (EOS_ID, add_request, assert_all_blocks_free, expected_outputs, fake_run,
                                      make_request, make_scheduler)

from epd.engine.request import Request
from epd.engine.scheduler import Scheduler


def right_draft(request: Request, k: int) -> list[int]:
    """What the fake model will produce next: a draft it accepts whole."""
    return [10_000 + request.num_tokens + i for i in range(k)]


def step_with_drafts(scheduler: Scheduler, drafts: dict[str, list[int]]):
    """As the engine: drafts for the decodes named, then schedule -> fake run -> update."""
    for request in scheduler.running:
        if request.request_id in drafts and request.num_tokens - request.num_computed_tokens == 1:
            request.draft_token_ids = list(drafts[request.request_id])
    output = scheduler.schedule()
    return output, scheduler.update(output, fake_run(output))


def test_an_accepted_draft_gives_its_tokens_and_a_bonus_in_one_step():
    scheduler = make_scheduler(block_size=4)
    request = make_request(6, max_tokens=20)
    add_request(scheduler, request)
    step_with_drafts(scheduler, {})  # the prompt, token 1
    request.draft_token_ids = right_draft(request, 3)
    output = scheduler.schedule()
    [scheduled] = output.scheduled
    assert (scheduled.num_new_tokens, scheduled.draft_token_ids) == (4, tuple(expected_outputs(6, 4)[1:]))
    assert scheduled.token_ids == expected_outputs(6, 4)  # the last token, then the draft
    assert request.draft_token_ids == []  # taken by the step
    [update] = scheduler.update(output, fake_run(output))
    assert update.new_token_ids == expected_outputs(6, 5)[1:]  # 3 accepted + the bonus
    assert request.output_token_ids == expected_outputs(6, 5)
    assert request.num_computed_tokens == request.num_tokens - 1  # the bonus token is not computed yet
    assert len(request.block_ids) == 3  # 11 tokens in blocks of 4
    assert scheduler.spec_decode.as_dict() == {
        "spec_decode_num_drafts": 1, "spec_decode_num_draft_tokens": 3, "spec_decode_num_accepted_tokens": 3,
        "spec_decode_num_accepted_tokens_per_pos": [1, 1, 1]}


def test_a_rejected_draft_gives_back_its_blocks_and_is_never_hashed():
    scheduler = make_scheduler(num_blocks=16, block_size=4)
    request = make_request(7, max_tokens=30)
    add_request(scheduler, request)
    step_with_drafts(scheduler, {})
    free_before = scheduler.block_manager.num_free_blocks
    draft = right_draft(request, 2) + [1, 2, 3, 4]  # two right, then wrong ones (6 draft tokens: 2 more blocks)
    output, [update] = step_with_drafts(scheduler, {request.request_id: draft})
    assert output.scheduled[0].num_new_tokens == 7
    assert update.new_token_ids == expected_outputs(7, 4)[1:]  # 2 accepted + the target's correction
    assert request.num_computed_tokens == 7 + 3 and len(request.block_ids) == 3  # 11 tokens: 3 blocks, not 4
    assert scheduler.block_manager.num_free_blocks == free_before - 1
    assert scheduler.spec_decode.accepted_per_position == [1, 1, 0, 0, 0, 0]
    step_with_drafts(scheduler, {})  # position 10 computed: block 2 (positions 8..11) still not full
    step_with_drafts(scheduler, {})  # now it is, with the accepted tokens
    # the third block's KV slots 10, 11 first held the rejected draft tokens 1, 2: its hash is the true tokens'
    true = make_request(prompt_token_ids=request.all_token_ids[:13], max_tokens=1)
    assert scheduler.block_manager.get_computed_blocks(true) == (request.block_ids[:3], 12)
    rejected = make_request(prompt_token_ids=request.all_token_ids[:10] + [1, 2, 3], max_tokens=1)
    assert scheduler.block_manager.get_computed_blocks(rejected) == (request.block_ids[:2], 8)


def test_outputs_equal_a_run_without_drafts_whatever_the_drafts():
    plain, spec = make_scheduler(num_blocks=24, block_size=4), make_scheduler(num_blocks=24, block_size=4)
    runs = {plain: [], spec: []}
    for scheduler, requests in runs.items():
        for n in (5, 9, 3):
            requests.append(make_request(n, max_tokens=11))
            add_request(scheduler, requests[-1])
    while plain.has_unfinished():
        plain.update(out := plain.schedule(), fake_run(out))
    step = 0
    while spec.has_unfinished():  # drafts partly right, partly wrong, of every length 0..3
        step += 1
        step_with_drafts(spec, {r.request_id: right_draft(r, step % 3) + [step] * (step % 2) for r in spec.running})
    assert spec.spec_decode.num_accepted_tokens > 0 and spec.spec_decode.num_accepted_tokens \
        < spec.spec_decode.num_draft_tokens
    assert [r.output_token_ids for r in runs[spec]] == [r.output_token_ids for r in runs[plain]] \
        == [expected_outputs(n, 11) for n in (5, 9, 3)]
    assert_all_blocks_free(spec)


def test_drafts_fit_the_budget_and_leave_the_rest_to_a_chunked_prefill():
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=10)
    first = make_request(4, max_tokens=20)
    add_request(scheduler, first)
    step_with_drafts(scheduler, {})
    second = make_request(30, max_tokens=2)
    add_request(scheduler, second)
    output, _ = step_with_drafts(scheduler, {first.request_id: right_draft(first, 5)})
    decode, prefill = output.scheduled
    assert (decode.request_id, decode.num_new_tokens) == (first.request_id, 6)  # the decode and its 5 drafts
    assert (prefill.request_id, prefill.num_new_tokens, prefill.is_last_chunk) == (second.request_id, 4, False)
    assert output.num_batched_tokens == 10
    output, _ = step_with_drafts(scheduler, {first.request_id: right_draft(first, 20)})
    assert output.scheduled[0].num_new_tokens == 10 and len(output.scheduled) == 1  # the budget caps the draft


def test_drafts_stay_within_max_tokens_and_max_model_len():
    scheduler = make_scheduler(block_size=4, max_model_len=16)
    short, near_end = make_request(4, max_tokens=3), make_request(12, max_tokens=None)
    add_request(scheduler, short)
    add_request(scheduler, near_end)
    step_with_drafts(scheduler, {})
    output, updates = step_with_drafts(scheduler, {short.request_id: right_draft(short, 5),
                                                   near_end.request_id: right_draft(near_end, 5)})
    by_id = {s.request_id: s for s in output.scheduled}
    assert len(by_id[short.request_id].draft_token_ids) == 1  # 1 out, 2 to go: one draft token and the bonus
    assert len(by_id[near_end.request_id].draft_token_ids) == 2  # 13 tokens of 16: 2 drafts + 1 bonus
    assert [u.finish_reason for u in updates] == ["length", "length"]
    assert short.output_token_ids == expected_outputs(4, 3) and near_end.num_tokens == 16
    assert_all_blocks_free(scheduler)


def test_a_stop_token_inside_the_accepted_tokens_drops_the_rest():
    scheduler = make_scheduler(block_size=4)
    request = make_request(4, max_tokens=20, eos_token_ids=(EOS_ID,))
    add_request(scheduler, request)
    step_with_drafts(scheduler, {})

    def model(r: Request) -> int:  # says EOS after two more tokens
        return EOS_ID if r.num_output_tokens == 3 else 10_000 + r.num_tokens

    request.draft_token_ids = [10_005, 10_006, EOS_ID, 10_008]
    output = scheduler.schedule()
    [update] = scheduler.update(output, fake_run(output, model))
    assert update.new_token_ids == [10_005, 10_006, EOS_ID] and update.finish_reason == "stop"
    assert request.output_token_ids[-1] == EOS_ID
    assert_all_blocks_free(scheduler)


def test_a_draft_never_makes_anyone_preempt():
    scheduler = make_scheduler(num_blocks=4, block_size=4, enable_prefix_caching=False)
    a, b = make_request(3, max_tokens=8), make_request(3, max_tokens=8)
    add_request(scheduler, a)
    add_request(scheduler, b)
    step_with_drafts(scheduler, {})  # both prefilled: 2 blocks held, 2 free
    output, _ = step_with_drafts(scheduler, {a.request_id: right_draft(a, 7), b.request_id: right_draft(b, 7)})
    assert output.preempted_request_ids == [] and scheduler.num_preemptions == 0
    assert sum(len(s.draft_token_ids) for s in output.scheduled) <= 8  # what the free blocks hold
    while scheduler.has_unfinished():
        step_with_drafts(scheduler, {r.request_id: right_draft(r, 7) for r in scheduler.running})
    assert scheduler.num_preemptions == 0
    assert a.output_token_ids == expected_outputs(3, 8) and b.output_token_ids == expected_outputs(3, 8)
    assert_all_blocks_free(scheduler)


def test_a_draft_leaves_the_blocks_a_waiting_prompt_needs():
    scheduler = make_scheduler(num_blocks=6, block_size=4, enable_prefix_caching=False)
    running = make_request(3, max_tokens=20)
    add_request(scheduler, running)
    step_with_drafts(scheduler, {})  # one block held, five free
    waiting = make_request(16, max_tokens=2)  # its prompt takes four
    add_request(scheduler, waiting)
    output, _ = step_with_drafts(scheduler, {running.request_id: right_draft(running, 12)})
    decode, prefill = output.scheduled
    assert len(decode.draft_token_ids) == 4  # the slots of one more block, not the twelve asked
    assert (prefill.request_id, prefill.num_new_tokens) == (waiting.request_id, 16)  # admitted beside it


def test_preemption_clears_a_proposed_draft_and_the_recompute_is_exact():
    scheduler = make_scheduler(num_blocks=5, block_size=4, enable_prefix_caching=False)
    requests = [make_request(6, max_tokens=9) for _ in range(2)]
    for request in requests:
        add_request(scheduler, request)
    while scheduler.has_unfinished():
        step_with_drafts(scheduler, {r.request_id: right_draft(r, 3)[:2] + [7] for r in scheduler.running})
        for request in scheduler.waiting:
            assert request.draft_token_ids == []  # preempted: its draft went with its KV
    assert scheduler.num_preemptions > 0 and scheduler.spec_decode.num_accepted_tokens > 0
    assert [r.output_token_ids for r in requests] == [expected_outputs(6, 9)] * 2
    assert_all_blocks_free(scheduler)


def test_stats_carry_the_spec_decode_counters():
    scheduler = make_scheduler()
    assert {k: v for k, v in scheduler.stats().items() if k.startswith("spec_decode")} == {
        "spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0, "spec_decode_num_accepted_tokens": 0,
        "spec_decode_num_accepted_tokens_per_pos": []}
