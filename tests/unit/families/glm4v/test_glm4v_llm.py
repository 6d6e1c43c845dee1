"""GLM-4.1V and GLM-4.5V served by the offline `LLM` (its encoder in-process, the
paged engine) give transformers' greedy tokens and top-5 logprobs on the same
random checkpoint, float32: text, one image, two images, a multi-turn chat;
each prompt prefilled in one step, then in chunks that cut through images,
the mixed batch under a KV budget that forces preemption."""
from __future__ import annotations

from functools import lru_cache

import pytest
import torch
from testkit.family_checkpoints import family_checkpoint
from testkit.hf_reference import _load, hf_greedy, hf_greedy_logprobs, hf_inputs
from testkit.media import CHATS, MIXED_BATCH, images_of

from epd.transport.wire.sampling import SamplingParams

FAMILIES = ["glm4v", "glm4v_moe"]
NUM_TOKENS = 8
TOP = 5


@lru_cache(maxsize=None)
def _hf_greedy_logprobs(model_dir: str, case: str) -> tuple[list[int], list[int], list[list]]:
    """(prompt ids, greedy tokens, each step's top-5 (token, logprob)) by transformers, one full forward a token."""
    messages, images = CHATS[case]
    model, _, _ = _load(model_dir)
    return hf_greedy_logprobs(model, hf_inputs(model_dir, messages, images), NUM_TOKENS, TOP)


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 16], ids=["one-prefill", "chunks"])
@pytest.mark.parametrize("family", FAMILIES)
def test_llm_chat_equals_transformers_tokens_and_logprobs(family, max_num_batched_tokens):
    from epd import LLM

    model_dir = family_checkpoint(family)
    llm = LLM(model_dir, dtype="float32", device="cpu", max_num_batched_tokens=max_num_batched_tokens)
    assert llm.engine.info.family == family
    cases = list(CHATS)
    outs = llm.chat([CHATS[c][0] for c in cases],
                    SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=TOP))
    for case, out in zip(cases, outs):
        ref_prompt, ref_tokens, ref_logprobs = _hf_greedy_logprobs(model_dir, case)
        assert out.prompt_token_ids == ref_prompt, case
        assert out.outputs[0].token_ids == ref_tokens, case
        tops = [lp.top for lp in out.outputs[0].logprobs]
        assert [[t for t, _ in top] for top in tops] == [[t for t, _ in top] for top in ref_logprobs], case
        torch.testing.assert_close([[v for _, v in top] for top in tops],
                                   [[v for _, v in top] for top in ref_logprobs], atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_batch_with_preemption_and_split_images(family):
    from epd import LLM

    model_dir = family_checkpoint(family)
    expected = [hf_greedy(model_dir, c, images_of(c), num_tokens=NUM_TOKENS) for c in MIXED_BATCH]
    llm = LLM(model_dir, num_kv_blocks=14, max_num_batched_tokens=24, max_num_seqs=8, dtype="float32", device="cpu")
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
