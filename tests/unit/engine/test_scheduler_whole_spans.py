"""Scheduler with `whole_mm_spans` (a model whose image tokens see each other both ways): no chunk
ends inside an image span, a span longer than the token budget is refused, and prefix-cache hits
and early prefill stay within the rule."""
from __future__ import annotations

import random

import pytest

from epd.engine.scheduler import Scheduler
from epd.engine.scheduler_config import SchedulerConfig
from testkit.engine_factories import (add_request, assert_all_blocks_free, expected_outputs, image_request,
                                      make_image_prompt, make_request, run_until_done, step)


def make_scheduler(max_num_batched_tokens: int, num_blocks: int = 64, whole_mm_spans: bool = True,
                   **config) -> Scheduler:
    return Scheduler(SchedulerConfig(block_size=4, max_num_batched_tokens=max_num_batched_tokens, **config),
                     num_blocks=num_blocks, whole_mm_spans=whole_mm_spans)


def chunks_of(outputs, request_id: str) -> list[tuple[int, int]]:
    return [(s.start, s.end) for out in outputs for s in out.scheduled if s.request_id == request_id]


def test_a_chunk_ends_before_a_span_it_cannot_take_whole():
    token_ids, span = make_image_prompt(3, 10, 2, mm_hash="cat")  # image at [3, 13)
    outputs = {}
    for whole in (False, True):
        scheduler = make_scheduler(12, whole_mm_spans=whole)
        request = make_request(prompt_token_ids=token_ids, mm_spans=[span], max_tokens=2)
        scheduler.add_request(request)
        outputs[whole] = chunks_of(run_until_done(scheduler), request.request_id)
        assert request.output_token_ids == expected_outputs(15, 2)
        assert_all_blocks_free(scheduler)
    assert outputs[False][:2] == [(0, 12), (12, 15)]  # the causal model's chunks split the image
    assert outputs[True][:2] == [(0, 3), (3, 15)]  # the image whole, in the second step


def test_an_image_longer_than_the_token_budget_is_refused_at_admission():
    token_ids, span = make_image_prompt(3, 10, 2, mm_hash="cat")
    scheduler = make_scheduler(8)
    with pytest.raises(ValueError, match="does not fit one step's token budget"):
        scheduler.add_request(make_request(prompt_token_ids=token_ids, mm_spans=[span]))
    make_scheduler(8, whole_mm_spans=False).add_request(make_request(prompt_token_ids=token_ids, mm_spans=[span]))


def test_no_chunk_ends_inside_a_span_under_load():
    """Many image requests, decodes taking budget, small budgets: every chunk of every step ends
    outside every span, and every request still finishes with its outputs."""
    rng = random.Random(0)
    for budget in (10, 13, 24):
        scheduler = make_scheduler(budget, num_blocks=200, prefill_priority=rng.choice(["fcfs", "cost"]))
        requests = [image_request([f"img{i}-{j}" for j in range(rng.randint(1, 3))],
                                  num_image_tokens=rng.randint(2, 10), num_text=rng.randint(1, 9),
                                  max_tokens=rng.randint(1, 5)) for i in range(12)]
        for request in requests:
            add_request(scheduler, request)
        outputs = run_until_done(scheduler)
        for out in outputs:
            for s in out.scheduled:
                assert not any(span.offset < s.end < span.end for span in s.request.mm_spans), (budget, s)
        for request in requests:
            assert request.output_token_ids == expected_outputs(request.num_prompt_tokens,
                                                                request.sampling_params.max_tokens)
        assert_all_blocks_free(scheduler)


def test_a_prefix_hit_inside_a_span_takes_the_rest_of_it_whole():
    """The hit's KV was computed with the whole image (one chunk took it): the next chunk starts
    inside the span and ends at or past its end."""
    token_ids, span = make_image_prompt(3, 10, 6, mm_hash="cat")  # image at [3, 13), 19 tokens
    scheduler = make_scheduler(16)
    first = make_request(prompt_token_ids=token_ids, mm_spans=[span], max_tokens=1)
    scheduler.add_request(first)
    assert chunks_of(run_until_done(scheduler), first.request_id) == [(0, 16), (16, 19)]
    again = make_request(prompt_token_ids=token_ids[:15], mm_spans=[span], max_tokens=1)
    scheduler.add_request(again)
    output, _ = step(scheduler)
    [chunk] = output.scheduled
    assert again.num_cached_tokens == 12  # three full blocks: the hit ends inside the image
    assert (chunk.start, chunk.end) == (12, 15) and chunk.mm_slices() == [(span, 9, 10)]


def test_early_prefill_stops_before_a_pending_image_then_takes_it_whole():
    token_ids, span = make_image_prompt(5, 8, 3, mm_hash="late")  # image at [5, 13)
    scheduler = make_scheduler(10)
    request = make_request(prompt_token_ids=token_ids, mm_spans=[span], max_tokens=1)
    add_request(scheduler, request, pending=["late"])
    output, _ = step(scheduler)
    assert [(s.start, s.end) for s in output.scheduled] == [(0, 5)]
    output, _ = step(scheduler)
    assert output.scheduled == []  # waiting for the image
    scheduler.images.arrived("late", object())
    outputs = run_until_done(scheduler)
    assert chunks_of(outputs, request.request_id) == [(5, 15), (15, 16)]
    assert request.output_token_ids == expected_outputs(16, 1)
