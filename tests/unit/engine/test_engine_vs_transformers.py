"""The paged engine under pressure gives exactly transformers' greedy tokens:
a mixed batch, a KV budget small enough to force preemption, and a token
budget that splits image placeholders across prefill chunks."""
from __future__ import annotations

import pytest
import torch
from testkit.hf_reference import hf_greedy
from testkit.media import MIXED_BATCH, image_bytes, image_part, images_of

from epd.transport.wire.sampling import SamplingParams

@pytest.fixture(scope="module")
def expected(tiny_model):
    return [hf_greedy(tiny_model, c, images_of(c), num_tokens=12) for c in MIXED_BATCH]


ON_GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs a CUDA GPU")])


@pytest.mark.parametrize("device", ["cpu", ON_GPU])  # cuda runs the Triton kernels
def test_mixed_batch_with_preemption_and_split_images(tiny_model, expected, device):
    from epd import LLM

    llm = LLM(tiny_model, num_kv_blocks=14, max_num_batched_tokens=24, max_num_seqs=8,
              dtype="float32", device=device)
    scheduler = llm.engine.scheduler
    split_inside_image = []
    original = scheduler.schedule

    def recording_schedule():
        out = original()
        for s in out.scheduled:
            for span in s.request.mm_spans:
                if span.offset < s.end < span.end:
                    split_inside_image.append(s.request_id)
        return out

    scheduler.schedule = recording_schedule
    outs = llm.chat(MIXED_BATCH, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.stats()["num_preemptions"] > 0, "the KV budget was meant to force preemption"
    assert split_inside_image, "the token budget was meant to split an image's placeholders"
    assert llm.engine.num_free_blocks() == llm.engine.num_blocks


def test_prefix_cache_hits_and_image_sensitivity(tiny_model):
    from epd import LLM

    llm = LLM(tiny_model, num_kv_blocks=64, dtype="float32", device="cpu")
    params = SamplingParams(temperature=0, max_tokens=4)
    system = {"role": "system", "content": "You are a careful assistant who describes pictures in detail. " * 3}

    def hits_after(conversation):
        before = llm.stats()["prefix_cache_hits"]
        llm.chat([conversation], params)
        return llm.stats()["prefix_cache_hits"] - before

    hits_after([system, {"role": "user", "content": "First question?"}])
    assert hits_after([system, {"role": "user", "content": "Second question?"}]) >= 32  # the system prompt

    image_prompt = lambda img: [{"role": "user", "content": [  # noqa: E731
        image_part(img), {"type": "text", "text": "Describe this picture in as much detail as you can."}]}]
    big_a, big_b = image_bytes(256, 256, seed=10), image_bytes(256, 256, seed=11)
    hits_after(image_prompt(big_a))
    assert hits_after(image_prompt(big_a)) >= 64  # same image + text: the image blocks hit
    # Same text, same size, different pixels: only the few blocks before the image may match.
    assert hits_after(image_prompt(big_b)) < 16
    assert llm.engine.num_free_blocks() == llm.engine.num_blocks


def test_abort_frees_every_block(tiny_model):
    from epd.engine.request import Request

    from epd import LLM

    llm = LLM(tiny_model, num_kv_blocks=32, dtype="float32", device="cpu")
    core = llm.engine
    for i in range(4):
        core.add_request(Request(f"r{i}", list(range(10, 60 + i)), SamplingParams(max_tokens=50, ignore_eos=True)))
    core.step()
    core.step()
    assert core.num_free_blocks() < core.num_blocks
    assert sorted(core.abort(["r0", "r1", "r2", "r3"])) == ["r0", "r1", "r2", "r3"]
    assert not core.has_unfinished()
    assert core.num_free_blocks() == core.num_blocks
