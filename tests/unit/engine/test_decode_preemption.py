"""A decode worker holds no embeddings for the images of a request prefilled
elsewhere, so it cannot compute that request's prompt again: it never
preempts one. Such a request short of a block waits (a request that can be
recomputed gives way instead); when every block is held by such waiters,
the latest is dropped for the caller to send elsewhere."""
from __future__ import annotations

from epd.engine.request import RequestStatus

from testkit.engine_factories import (assert_all_blocks_free, expected_outputs, make_image_prompt, make_request,
                                      make_scheduler, run_until_done, step)


def prefilled(num_prompt_tokens: int, image: str | None = None, max_tokens: int = 8):
    """A request prefilled on another worker (its first token sampled there), with
    an image at 2..num_prompt_tokens - 2 if `image`."""
    if image is None:
        request = make_request(num_prompt_tokens, max_tokens=max_tokens)
    else:
        token_ids, span = make_image_prompt(2, num_prompt_tokens - 4, 2, mm_hash=image)
        request = make_request(prompt_token_ids=token_ids, mm_spans=[span], max_tokens=max_tokens)
    request.output_token_ids.append(10_000 + num_prompt_tokens)  # what fake_token samples
    return request


def test_a_decode_worker_preempts_the_text_request_and_never_the_image_one():
    scheduler = make_scheduler(num_blocks=4, role="decode")  # 2 blocks each: full
    text = prefilled(6)  # arrives first: the old rule (latest arrival) would evict the image request
    image = prefilled(6, image="cat")
    assert scheduler.add_prefilled(text) is not None and scheduler.add_prefilled(image) is not None
    outputs = run_until_done(scheduler)
    preempted = [rid for o in outputs for rid in o.preempted_request_ids]
    assert preempted and set(preempted) == {text.request_id}
    assert image.num_preemptions == 0 and text.num_preemptions >= 1
    assert image.output_token_ids == expected_outputs(6, 8)
    assert text.output_token_ids == expected_outputs(6, 8)  # recomputed here (a local prefill)
    assert all(o.dropped_request_ids == [] for o in outputs)
    assert_all_blocks_free(scheduler)


def test_a_waiting_image_request_gets_the_next_free_blocks_before_new_arrivals():
    scheduler = make_scheduler(num_blocks=4, role="decode")
    text = prefilled(5, max_tokens=4)  # decodes at 5, 6, 7: finishes in step 3
    image = prefilled(6, image="cat")  # decodes at 6, 7, then needs a third block in step 3
    assert scheduler.add_prefilled(text) is not None and scheduler.add_prefilled(image) is not None
    step(scheduler)
    step(scheduler)
    output, _ = step(scheduler)
    assert [s.request_id for s in output.scheduled] == [text.request_id]  # the image request waits
    assert output.preempted_request_ids == [] and output.dropped_request_ids == []
    assert text.is_finished and scheduler.block_manager.num_free_blocks == 2
    newcomer = prefilled(4)
    assert scheduler.add_prefilled(newcomer) is None  # the free blocks go to the waiting request first
    output, _ = step(scheduler)
    assert [s.request_id for s in output.scheduled] == [image.request_id]
    assert scheduler.add_prefilled(newcomer) is not None
    run_until_done(scheduler)
    assert image.num_preemptions == 0 and image.output_token_ids == expected_outputs(6, 8)
    assert newcomer.output_token_ids == expected_outputs(4, 8)
    assert_all_blocks_free(scheduler)


def test_when_every_block_waits_on_image_requests_the_latest_is_dropped():
    scheduler = make_scheduler(num_blocks=4, role="decode")
    first, second = prefilled(6, image="cat"), prefilled(6, image="dog")
    assert scheduler.add_prefilled(first) is not None and scheduler.add_prefilled(second) is not None
    step(scheduler)
    output, _ = step(scheduler)  # both decode into the last free slot of their blocks
    assert len(output.scheduled) == 2 and scheduler.block_manager.num_free_blocks == 0
    output, _ = step(scheduler)  # both need a fresh block: neither may be preempted
    assert output.scheduled == [] and output.preempted_request_ids == []
    assert output.dropped_request_ids == [second.request_id]
    assert second.status is RequestStatus.FINISHED_ABORTED and second.block_ids == []
    assert second.request_id in output.finished_request_ids and scheduler.get_request(second.request_id) is None
    run_until_done(scheduler)
    assert first.output_token_ids == expected_outputs(6, 8) and first.num_preemptions == 0
    assert_all_blocks_free(scheduler)
