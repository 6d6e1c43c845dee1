"""The offline LLM on InternVL checkpoints (dense and MoE) gives transformers'
greedy tokens and top-5 logprobs: text, one image, two images, several turns,
and the 8-request mixed batch under a KV budget that forces preemption and a
token budget that splits images' placeholders across prefill chunks."""
from __future__ import annotations

import pytest
import torch
from testkit.internvl_reference import TOP, hf_greedy_logprobs
from testkit.media import CHATS, MIXED_BATCH, images_of

from epd.tools.make_model import make_model
from epd.transport.wire.sampling import SamplingParams

NUM_TOKENS = 8


@pytest.fixture(scope="module", params=["internvl-tiny", "internvl-moe-tiny"])
def checkpoint(request, tmp_path_factory) -> str:
    return str(make_model(tmp_path_factory.mktemp(request.param), request.param, seed=1))


def test_chats_give_transformers_tokens_and_logprobs(checkpoint):
    from epd import LLM

    llm = LLM(checkpoint, dtype="float32", device="cpu", max_num_batched_tokens=40)  # prompts in chunks
    assert llm.engine.info.family == "internvl"
    chats = list(CHATS.values())
    outs = llm.chat([m for m, _ in chats], SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True,
                                                         logprobs=TOP))
    for (messages, images), out in zip(chats, outs):
        prompt, tokens, logprobs = hf_greedy_logprobs(checkpoint, messages, images, NUM_TOKENS)
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == tokens
        tops = [lp.top for lp in out.outputs[0].logprobs]
        assert [[t for t, _ in top] for top in tops] == [[t for t, _ in top] for top in logprobs]
        torch.testing.assert_close([[v for _, v in top] for top in tops], [[v for _, v in top] for top in logprobs],
                                   atol=1e-4, rtol=0)


def test_mixed_batch_with_preemption_and_split_images(checkpoint):
    from epd import LLM

    expected = [hf_greedy_logprobs(checkpoint, c, images_of(c), NUM_TOKENS)[1] for c in MIXED_BATCH]
    llm = LLM(checkpoint, num_kv_blocks=15, max_num_batched_tokens=24, max_num_seqs=8, dtype="float32",
              device="cpu")
    scheduler = llm.engine.scheduler
    split_inside_image = []
    original = scheduler.schedule

    def recording_schedule():
        out = original()
        split_inside_image.extend(s.request_id for s in out.scheduled for span in s.request.mm_spans
                                  if span.offset < s.end < span.end)
        return out

    scheduler.schedule = recording_schedule
    outs = llm.chat(MIXED_BATCH, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.stats()["num_preemptions"] > 0, "the KV budget was meant to force preemption"
    assert split_inside_image, "the token budget was meant to split an image's placeholders"
    assert llm.engine.num_free_blocks() == llm.engine.num_blocks
