"""Early prefill on the tiny checkpoint: a request admitted before its images
are encoded is prefilled up to its first missing image, goes on as they
arrive (late and out of order), hits the prefix cache on the text before
them, survives preemption, and gives exactly transformers' greedy tokens.
An image that fails, or never comes, takes out only the requests waiting
for it: asked of the engine's image ledger, by the engine and by a worker."""
from __future__ import annotations

import pytest
from testkit.hf_reference import hf_greedy
from testkit.media import MIXED_BATCH, image_bytes, image_part, images_of

from epd.encoders.image_io import read_image_size
from epd.engine.request import Request
from epd.engine.worker.loop import EngineWorker
from epd.inputs.prompt import ImageRef
from epd.transport.wire.addresses import Addresses
from epd.transport.wire.channels import Receiver
from epd.transport.wire.messages import EncodeDone, PrefillRequest, TokenOutput, TokenOutputs
from epd.transport.wire.sampling import SamplingParams
from epd.transport.wire.worker_io import WorkerSpec

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
    prompt = llm.inputs.prompts.build(conversation, refs)
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


def run_until_idle(step, core) -> None:
    """`step()` until `core` has nothing to run (done, or waiting for images)."""
    for _ in range(200):
        if not core.has_unfinished():
            return
        step()
    raise AssertionError("the engine never went idle")


def test_a_failed_or_overdue_image_aborts_only_the_requests_waiting_for_it(llm):
    core = llm.engine
    images = [image_bytes(64, 48, seed=25), image_bytes(48, 64, seed=26), image_bytes(56, 56, seed=27)]
    token_ids, spans, [first, second] = prompt_of(llm, two_images(images[:2]), images[:2])
    [entry] = llm.encoder.encode(images[:1])
    core.add_request(Request("waits", list(token_ids), GREEDY, mm_spans=list(spans)), {first: entry},
                     pending_mm_hashes=[second])
    one_image = [SYSTEM, {"role": "user", "content": [image_part(images[2]), {"type": "text", "text": "What?"}]}]
    late_ids, late_spans, [third] = prompt_of(llm, one_image, images[2:])
    core.add_request(Request("late", late_ids, GREEDY, mm_spans=late_spans, arrival_time=100.0), {},
                     pending_mm_hashes=[third])
    run_until_idle(core.step, core)  # both run until they wait for an image
    assert core.num_waiting_for_images == 2
    assert core.fail_image(first) == []  # here already: nobody waits for it
    assert core.fail_image(second) == ["waits"]
    assert core.num_waiting_for_images == 1 and core.abort(["waits"]) == []  # gone already
    assert not core.add_embedding(second, entry)  # nobody uses it any more

    assert core.abort_overdue(now_s=700.0, max_wait_s=600.0) == []
    assert core.abort_overdue(now_s=700.5, max_wait_s=600.0) == ["late"]
    assert core.num_waiting_for_images == 0 and core.num_free_blocks() == core.num_blocks
    core.step()
    assert core.get_embedding(first) is None


def test_a_worker_answers_the_requests_whose_late_image_failed_and_serves_the_others(llm, tmp_path):
    """With early prefill a worker keeps no record of what an admitted request
    waits for: on an EncodeDone it asks the engine (EngineCore.add_embedding,
    fail_image). Real ZeroMQ, the real engine."""
    addresses = Addresses.ipc(tmp_path)
    collector = Receiver(addresses.collector(0))
    spec = WorkerSpec("pd-0", "pd", addresses.worker("pd", 1), (collector.address,), None, 0)
    worker = EngineWorker(spec, llm.engine)
    worker.heartbeat.interval_s = 3600.0
    hashes, entries = {}, {}
    try:
        for request_id, seed in (("bad", 31), ("gone", 33), ("fine", 35)):
            images = [image_bytes(64, 48, seed=seed), image_bytes(48, 64, seed=seed + 1)]
            token_ids, spans, hashes[request_id] = prompt_of(llm, two_images(images), images)
            entries[request_id] = llm.encoder.encode(images)
            worker._handle(PrefillRequest(request_id, token_ids, spans, GREEDY, [], None))
        assert len(worker.requests) == 3 and worker.arrivals.num_pending == 0  # all in the engine
        run_until_idle(worker._step, llm.engine)  # until each waits for its first image
        assert llm.engine.num_waiting_for_images == 3

        worker._handle(EncodeDone("bad", hashes["bad"][1], ok=False, error="truncated"))
        worker._handle(EncodeDone("gone", hashes["gone"][0], ok=True))  # "in the cache": this worker has none
        errors = {}
        for _ in range(2):
            out = collector.recv(timeout_s=5)
            assert isinstance(out, TokenOutput) and out.finish_reason == "error"
            errors[out.request_id] = out.error
        assert errors["bad"] == "image could not be encoded: truncated"
        assert "evicted" in errors["gone"]
        assert list(worker.requests) == ["fine"] and llm.engine.num_waiting_for_images == 1

        for mm_hash, entry in zip(reversed(hashes["fine"]), reversed(entries["fine"])):  # late, out of order
            worker._handle(EncodeDone("fine", mm_hash, ok=True, embeddings=entry.embeddings,
                                      extras=entry.extras, meta=entry.meta))
        run_until_idle(worker._step, llm.engine)
        tokens = []
        while len(tokens) < NUM_TOKENS:
            message = collector.recv(timeout_s=5)
            assert isinstance(message, TokenOutputs)
            tokens += [t for out in message.outputs for t in out.token_ids]
        assert len(tokens) == NUM_TOKENS and worker.requests == {}
        assert llm.engine.num_free_blocks() == llm.engine.num_blocks
    finally:
        worker.close()
        collector.close()
