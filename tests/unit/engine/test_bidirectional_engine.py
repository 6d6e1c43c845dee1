"""A model that asks for bidirectional attention among an image's tokens (`bidirectional_mm`),
end to end through the offline LLM: the tiny Qwen3-VL checkpoint with the flag set. Chunked
prefill (the scheduler never splits an image) and prefix-cache hits give the one-chunk run's
prompt logprobs and tokens, and the flag changes them (the ranges reach the attention)."""
from __future__ import annotations

import pytest
import torch
from testkit.media import image_bytes, image_part

from epd.transport.wire.sampling import SamplingParams

SYSTEM = {"role": "system", "content": "You look at pictures and answer briefly. " * 2}
IMAGES = [image_bytes(64, 48, seed=31), image_bytes(48, 64, seed=32)]
CHAT = [SYSTEM, {"role": "user", "content": [image_part(IMAGES[0]), {"type": "text", "text": "and"},
                                             image_part(IMAGES[1]), {"type": "text", "text": "?"}]}]
PROMPT_LOGPROBS = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5)


def _llm(tiny_model, **settings):
    from epd import LLM

    return LLM(tiny_model, num_kv_blocks=64, dtype="float32", device="cpu", **settings)


@pytest.fixture
def bidirectional(monkeypatch):
    from epd.families.qwen_vl.text_model import Qwen3VLForCausalLM

    monkeypatch.setattr(Qwen3VLForCausalLM, "bidirectional_mm", True, raising=False)


def _prompt_logprobs(out) -> torch.Tensor:
    return torch.tensor([step.logprob for step in out.prompt_logprobs[1:]], dtype=torch.float64)


def _tokens_and_top(out):
    return out.outputs[0].token_ids, [[t for t, _ in step.top] for step in out.outputs[0].logprobs]


def test_chunks_and_prefix_hits_equal_one_chunk_and_the_flag_matters(tiny_model, bidirectional, monkeypatch):
    whole = _llm(tiny_model)
    assert whole.engine.scheduler.chunks.whole_mm_spans and whole.engine.runner.bidirectional_mm
    (full,) = whole.chat(CHAT, PROMPT_LOGPROBS)
    (greedy,) = whole.chat(CHAT, GREEDY)

    chunked = _llm(tiny_model, max_num_batched_tokens=33)  # chunks [0, 33), [33, 63): not into the image at [63, 67)
    (out,) = chunked.chat(CHAT, PROMPT_LOGPROBS)
    torch.testing.assert_close(_prompt_logprobs(out), _prompt_logprobs(full), atol=1e-4, rtol=0)
    first = chunked.chat(CHAT, GREEDY)[0]
    again = chunked.chat(CHAT, GREEDY)[0]  # its prompt's blocks from the prefix cache
    assert chunked.engine.stats()["prefix_cache_hits"] > 0
    assert _tokens_and_top(first) == _tokens_and_top(again) == _tokens_and_top(greedy)

    monkeypatch.undo()  # the same checkpoint, causal
    (causal,) = _llm(tiny_model).chat(CHAT, PROMPT_LOGPROBS)
    assert (_prompt_logprobs(causal) - _prompt_logprobs(full)).abs().max() > 1e-3


def _run(core, request, entries) -> list[tuple[int, list[tuple[int, float]]]]:
    """`request` run to its end on `core`: each token with its top logprobs."""
    core.add_request(request, entries)
    out = []
    while core.has_unfinished():
        result = core.step()
        for update in result.updates:
            out += [(t, step.top) for t, step in zip(update.new_token_ids, result.logprobs[update.request_id])]
    return out


def test_a_prefix_hit_ending_inside_an_image_gives_the_uncached_run(tiny_model, bidirectional):
    """The cached blocks end inside the first image (their KV was computed with the whole image):
    the next chunk takes the image's rest whole and the tokens and logprobs are an uncached run's."""
    from epd.encoders.image_io import read_image_size
    from epd.engine.request import Request
    from epd.inputs.prompt import ImageRef

    cached, fresh = _llm(tiny_model), _llm(tiny_model)
    refs = [ImageRef(*read_image_size(b), cached.encoder.mm_hash(b)) for b in IMAGES]
    prompt = cached.inputs.prompts.build(CHAT, refs)
    ids, spans = list(prompt.token_ids), list(prompt.mm_spans)
    entries = dict(zip([r.mm_hash for r in refs], cached.encoder.encode(IMAGES)))
    block_size = cached.engine.scheduler.config.block_size
    boundary = (spans[0].offset // block_size + 1) * block_size
    assert spans[0].offset < boundary < spans[0].end < spans[1].offset, "the first image must hold a block boundary"

    # a shorter prompt with the first image whole: its blocks up to `boundary` enter the prefix cache
    _run(cached.engine, Request("first", ids[:spans[0].end + 1], GREEDY, mm_spans=spans[:1]), entries)
    hit = Request("hit", ids, GREEDY, mm_spans=spans)
    got = _run(cached.engine, hit, entries)
    assert hit.num_cached_tokens == boundary
    want = _run(fresh.engine, Request("fresh", ids, GREEDY, mm_spans=spans), entries)
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, top), (_, ref) in zip(got, want):
        assert [t for t, _ in top] == [t for t, _ in ref]
        torch.testing.assert_close(torch.tensor([p for _, p in top]), torch.tensor([p for _, p in ref]),
                                   atol=1e-4, rtol=0)
