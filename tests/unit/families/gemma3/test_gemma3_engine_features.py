"""The engine's features on Gemma 3 (nothing in them names a family): the prefix cache reuses
an image chat's KV past its images and answers as without it; n-gram speculation gives the
greedy tokens of no speculation, with drafts accepted; structured output constrains the answer."""
from __future__ import annotations

import pytest
from testkit.engine_factories import cpu_llm
from testkit.media import MIXED_BATCH

from epd.transport.wire.sampling import SamplingParams, StructuredOutputsParams

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
TOKEN_PROMPTS = [[11, 12, 13, 14, 15] * 5, [300, 301, 302] * 7 + [300], [40, 41, 42, 43, 44, 45] * 4]


@pytest.fixture(scope="module")
def plain(gemma3_model):
    return cpu_llm(gemma3_model)


def test_the_prefix_cache_reuses_an_image_chat_and_answers_alike(plain, gemma3_model):
    chat = MIXED_BATCH[7]  # two images, then text
    [first] = plain.chat([chat], GREEDY)
    hits = plain.stats()["prefix_cache_hits"]
    [again] = plain.chat([chat], GREEDY)
    uncached = cpu_llm(gemma3_model, enable_prefix_caching=False)
    [fresh] = uncached.chat([chat], GREEDY)
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == fresh.outputs[0].token_ids
    image_token = plain.engine.info.image_token_id
    last_image_end = max(i for i, t in enumerate(again.prompt_token_ids) if t == image_token) + 1
    assert plain.stats()["prefix_cache_hits"] - hits >= last_image_end
    assert uncached.stats()["prefix_cache_hits"] == 0


def test_ngram_speculation_gives_the_greedy_tokens(plain, gemma3_model):
    spec = cpu_llm(gemma3_model, speculative_config=SPEC)
    chats = MIXED_BATCH[:3]
    want = [o.outputs[0].token_ids for o in plain.chat(chats, GREEDY) + plain.generate(TOKEN_PROMPTS, GREEDY)]
    got = [o.outputs[0].token_ids for o in spec.chat(chats, GREEDY) + spec.generate(TOKEN_PROMPTS, GREEDY)]
    assert got == want
    assert spec.stats()["spec_decode_num_accepted_tokens"] > 0


def test_structured_output_constrains_the_answer(plain):
    choices = ["red chair", "blue sky"]
    params = SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(choice=choices))
    outs = plain.chat(MIXED_BATCH[1:3], params)
    assert all(o.outputs[0].text in choices for o in outs)
