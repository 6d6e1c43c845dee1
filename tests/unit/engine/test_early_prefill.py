"""Early prefill on the tiny checkpoint: a request admitted before its images
are encoded is prefilled up to its first missing image, goes on as they
arrive (late and out of order), hits the prefix cache on the text before
them, survives preemption, and gives exactly transformers' greedy tokens."""
from __future__ import annotations

import pytest
from testkit.hf_reference import hf_greedy
from testkit.media import MIXED_BATCH, image_bytes, image_part, images_of

from epd.encoders.image_io import read_image_size
from epd.engine.request import Request
from epd.inputs.prompt import ImageRef
from epd.transport.sampling import SamplingParams

NUM_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
SYSTEM = {"role": "system", "content": "You look at pictures and answer briefly and carefully. " * 3}
IMAGES = [image_bytes(64, 48, seed=21), image_bytes(48, 64, seed=22)]


def two_images(images: list[bytes]) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": [image_part(images[0]), {"type": "text", "text": "and"},
                                                 image_part(images[1]), {"type": "text", "text": "Compare."}]}]


LATE = two_images(IMAGES)
OTHERS = [MIXED_BATCH[0], MIXED_BATCH[3], MIXED_BATCH[5]]  # text-only, to fill the KV cache


@pytest.fixture(scope="module")
def llm(tiny_model):
    """KV for ~2 prompts at once and a token budget that splits prompts, so
    the batch below preempts."""
    from epd import LLM

    return LLM(tiny_model, num_kv_blocks=16, max_num_batched_tokens=32, dtype="float32", device="cpu")


def prompt_of(llm, conversation, images: list[bytes] | None = None):
    images = images_of(conversation) if images is None else images
    refs = [ImageRef(*read_image_size(b), llm.encoder.mm_hash(b)) for b in images]
    prompt = llm.prompts.build(conversation, refs)
    return prompt.token_ids, prompt.mm_spans, [r.mm_hash for r in refs]


def test_images_arriving_late_and_out_of_order_give_transformers_tokens(llm, tiny_model):
    expected = hf_greedy(tiny_model, LATE, IMAGES, num_tokens=NUM_TOKENS)
    expected_others = [hf_greedy(tiny_model, c, [], num_tokens=NUM_TOKENS) for c in OTHERS]
    core = llm.engine
    token_ids, spans, [first, second] = prompt_of(llm, LATE, IMAGES)

    # The text before the images, computed once: it is in the prefix cache.
    core.add_request(Request("warm", token_ids[:spans[0].offset], GREEDY))
    while core.has_unfinished():
        core.step()
    preemptions_before = core.stats()["num_preemptions"]

    late = Request("late", list(token_ids), GREEDY, mm_spans=list(spans))
    core.add_request(late, {}, pending_mm_hashes=[first, second])
    while core.has_unfinished():  # until it waits for its first image
        core.step()
    assert late.num_cached_tokens >= 32  # the text before the images hit the prefix cache
    assert late.num_computed_tokens == spans[0].offset and late.output_token_ids == []
    assert core.num_waiting_for_images == 1

    others = []
    for i, conversation in enumerate(OTHERS):  # they take the blocks it does not hold
        ids, _, _ = prompt_of(llm, conversation)
        others.append(Request(f"other-{i}", ids, GREEDY))
        core.add_request(others[-1])
    encoded = dict(zip([first, second], llm.encoder.encode(IMAGES)))
    assert core.add_embedding(second, encoded[second])  # the second image first
    for _ in range(2):
        core.step()
    assert late.num_computed_tokens == spans[0].offset  # still waiting for the first
    assert core.add_embedding(first, encoded[first])  # then it needs blocks others hold
    while core.has_unfinished():
        core.step()
    assert late.output_token_ids == expected
    assert [r.output_token_ids for r in others] == expected_others
    assert core.stats()["num_preemptions"] > preemptions_before, "the KV budget was meant to force preemption"
    assert core.num_free_blocks() == core.num_blocks
    assert not core.add_embedding(first, encoded[first])  # nobody waits for it any more
    core.step()
    assert core.get_embedding(first) is None and core.get_embedding(second) is None


def test_aborting_a_request_waiting_for_an_image_frees_its_blocks(llm):
    core = llm.engine
    images = [image_bytes(64, 48, seed=23), image_bytes(48, 64, seed=24)]  # none of it cached
    token_ids, spans, [first, second] = prompt_of(llm, two_images(images), images)
    [entry] = llm.encoder.encode(images[:1])
    core.add_request(Request("waits", list(token_ids), GREEDY, mm_spans=list(spans)), {first: entry},
                     pending_mm_hashes=[second])
    while core.has_unfinished():  # runs until it waits for the second image
        core.step()
    assert core.num_waiting_for_images == 1 and core.num_free_blocks() < core.num_blocks
    assert core.abort(["waits"]) == ["waits"]
    assert core.num_free_blocks() == core.num_blocks and core.num_waiting_for_images == 0
    assert not core.add_embedding(second, entry)
    core.step()
    assert core.get_embedding(first) is None
