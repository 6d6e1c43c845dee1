"""Speculative decoding (n-gram) on the tiny checkpoint: greedy output is the
output without speculation, token for token, while drafts are accepted (the
engine's counters say how many): with images and M-RoPE, preemption and
chunked prefill (against transformers), stop strings, max_tokens, logprobs
(the target's), n > 1, penalties and min_tokens, bad words, structured
output. Sampled requests are verified by rejection sampling: drafts are
accepted, a seeded one's output is its own (test_spec_sampled_engine.py
holds its distribution to the one without speculation)."""
from __future__ import annotations

import pytest
from testkit.engine_factories import cpu_llm
from testkit.hf_reference import hf_greedy
from testkit.media import MIXED_BATCH, images_of

from epd.transport.wire.sampling import SamplingParams, StructuredOutputsParams as SO

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# token-id prompts whose greedy continuations the n-gram proposer can draft from: phrases that repeat
PROMPTS = [[11, 12, 13, 14, 15] * 5, [300, 301, 302] * 7 + [300], [7, 8] * 12, list(range(500, 540)),
           [40, 41, 42, 43, 44, 45, 46, 47] * 3 + [40, 41]]


@pytest.fixture(scope="module")
def plain(tiny_model):
    return cpu_llm(tiny_model)


@pytest.fixture(scope="module")
def spec(tiny_model):
    return cpu_llm(tiny_model, speculative_config=SPEC)


def _accepted(llm) -> int:
    return llm.stats()["spec_decode_num_accepted_tokens"]


def _both(plain, spec, params, prompts=PROMPTS):
    """(without, with speculation) outputs of `generate`, and the draft tokens accepted meanwhile."""
    before = _accepted(spec)
    without, with_spec = plain.generate(prompts, params), spec.generate(prompts, params)
    return [o.outputs for o in without], [o.outputs for o in with_spec], _accepted(spec) - before


def test_greedy_tokens_are_the_same_and_drafts_are_accepted(plain, spec):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    without, with_spec, accepted = _both(plain, spec, params)
    assert [[c.token_ids for c in o] for o in with_spec] == [[c.token_ids for c in o] for o in without]
    assert accepted > 0
    stats = spec.stats()
    assert stats["spec_decode_num_accepted_tokens"] <= stats["spec_decode_num_draft_tokens"]
    assert sum(stats["spec_decode_num_accepted_tokens_per_pos"]) == stats["spec_decode_num_accepted_tokens"]
    assert plain.stats()["spec_decode_num_drafts"] == 0
    assert spec.engine.num_free_blocks() == spec.engine.num_blocks


def test_images_preemption_and_chunked_prefill_match_transformers(tiny_model, plain):
    """M-RoPE positions of the draft continue the text after the images; a tiny KV budget
    preempts requests with drafts in flight; a small token budget chunks prompts beside them.
    The reference: the engine without speculation (test_engine_vs_transformers holds it to
    transformers on this batch), and transformers itself for one image chat."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm = cpu_llm(tiny_model, num_kv_blocks=16, max_num_batched_tokens=24, max_num_seqs=8, speculative_config=SPEC)
    outs = [o.outputs[0].token_ids for o in llm.chat(MIXED_BATCH, params)]
    assert outs == [o.outputs[0].token_ids for o in plain.chat(MIXED_BATCH, params)]
    assert outs[1] == hf_greedy(tiny_model, MIXED_BATCH[1], images_of(MIXED_BATCH[1]), num_tokens=20)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert llm.engine.num_free_blocks() == llm.engine.num_blocks


def test_max_tokens(plain, spec):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 2, 5, 13, 7)]
    without, with_spec, _ = _both(plain, spec, params)
    assert [o[0].token_ids for o in with_spec] == [o[0].token_ids for o in without]
    assert [len(o[0].token_ids) for o in with_spec] == [1, 2, 5, 13, 7]


def test_stop_strings_end_where_they_end_without_speculation(plain, spec):
    reference = plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    stops = [o.outputs[0].text[len(o.outputs[0].text) // 2:][:3] for o in reference]  # text from the middle
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[s]) for s in stops]
    without, with_spec, _ = _both(plain, spec, params)
    got = [(c.text, c.token_ids, c.finish_reason) for [c] in with_spec]
    assert got == [(c.text, c.token_ids, c.finish_reason) for [c] in without]
    assert any(reason == "stop" for _, _, reason in got)


def test_logprobs_are_the_targets(plain, spec):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    without, with_spec, accepted = _both(plain, spec, params)
    assert accepted > 0
    for [a], [b] in zip(without, with_spec):
        assert b.token_ids == a.token_ids and len(b.logprobs) == len(a.logprobs) == 24
        for x, y in zip(a.logprobs, b.logprobs):
            assert (y.token_id, y.rank, [t for t, _ in y.top]) == (x.token_id, x.rank, [t for t, _ in x.top])
            assert y.logprob == pytest.approx(x.logprob, abs=1e-4)


def test_n_greater_than_one(plain, spec):
    without, with_spec, accepted = _both(plain, spec, SamplingParams(n=3, temperature=0, max_tokens=20,
                                                                     ignore_eos=True))
    assert accepted > 0
    assert [[c.token_ids for c in o] for o in with_spec] == [[c.token_ids for c in o] for o in without]
    assert all(len({tuple(c.token_ids) for c in o}) == 1 for o in with_spec)


def test_penalties_min_tokens_and_bad_words_see_each_draft_prefix(plain, spec):
    """Each verified position is scored with the output it would follow, drafts included."""
    params = [SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=24, presence_penalty=0.8, frequency_penalty=0.5,
                             ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=24, min_tokens=20),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words=["the"]),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logit_bias={13: 3.0, 302: -2.0})]
    without, with_spec, _ = _both(plain, spec, params)
    assert [o[0].token_ids for o in with_spec] == [o[0].token_ids for o in without]


def test_structured_output_is_not_advanced_by_a_rejected_draft(plain, spec):
    """The prompts' n-grams propose tokens the grammar refuses: rejected at their row's
    mask, and the matcher rolled back, so the constrained output is the one without drafts."""
    so = [SO(regex=r"(ab|cd|[0-9]){4,30}"), SO(choice=["red red red", "blue blue"]),
          SO(json={"type": "object", "properties": {"k": {"type": "array", "items": {"type": "integer"}}}})]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=s) for s in so]
    drafts_before = spec.stats()["spec_decode_num_draft_tokens"]
    without, with_spec, _ = _both(plain, spec, params, PROMPTS[:3])
    assert [(o[0].token_ids, o[0].finish_reason) for o in with_spec] == \
        [(o[0].token_ids, o[0].finish_reason) for o in without]
    assert spec.stats()["spec_decode_num_draft_tokens"] > drafts_before


def test_sampled_drafts_are_accepted_at_low_temperature(plain, spec):
    """Sampled requests get drafts and rejection sampling keeps some: near greedy,
    the target mostly agrees with the n-gram proposer."""
    params = SamplingParams(temperature=0.05, seed=7, max_tokens=24, ignore_eos=True)
    before = spec.stats()["spec_decode_num_drafts"]
    _, with_spec, accepted = _both(plain, spec, params)
    assert accepted > 0 and spec.stats()["spec_decode_num_drafts"] > before
    assert all(len(o[0].token_ids) == 24 for o in with_spec)
    assert spec.engine.num_free_blocks() == spec.engine.num_blocks


def test_a_seeded_sampled_request_does_not_depend_on_the_batch(spec):
    """Its draft, acceptance and bonus draws come from its own generator."""
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=16, ignore_eos=True)
    others = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)
    alone = spec.generate([PROMPTS[0]], params)[0].outputs[0].token_ids
    batch = spec.generate(PROMPTS, [params] + [others] * (len(PROMPTS) - 1))
    assert batch[0].outputs[0].token_ids == alone
    assert spec.generate([PROMPTS[0]], params)[0].outputs[0].token_ids == alone
