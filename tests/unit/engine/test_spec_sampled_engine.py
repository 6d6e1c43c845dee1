"""Speculative decoding of sampled requests keeps the target's distribution.

On the tiny checkpoint, a prompt whose greedy continuation loops (135, 1015,
21, ...) lets the n-gram proposer draft the loop; at temperature 3 the target
gives the loop's next token a probability of roughly 0.05-0.5, so drafts are
accepted only in part and rejection sampling decides. N seeded requests
(seeds 0..N-1: the test is deterministic) are sampled with and without
speculation; at each of the first tokens after the first, the frequency of
the loop token (the draft) must agree within 0.1 (about 3 standard deviations
of the difference of two binomial frequencies at N=300).

A broken verifier fails this: accepting every draft moves those frequencies
by 0.34-0.47, and sampling a rejected position from p instead of the residual
max(0, p - q) by 0.11-0.12 (measured when this test was written)."""
from __future__ import annotations

import pytest

from epd.transport.wire.sampling import SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPT = [40, 41, 42, 43, 44, 45, 46, 47] * 3 + [40, 41, 135, 1015, 21, 135, 1015, 21]
LOOP = {1: 1015, 2: 21, 3: 135}  # position -> the token the proposer drafts there after the loop's start
N = 300
BOUND = 0.1


def _sample(tiny_model, **settings) -> tuple[list[list[int]], dict]:
    from epd import LLM

    llm = LLM(tiny_model, dtype="float32", device="cpu", num_kv_blocks=512, max_num_seqs=128, **settings)
    params = [SamplingParams(temperature=3.0, seed=i, max_tokens=4, ignore_eos=True) for i in range(N)]
    return [o.outputs[0].token_ids for o in llm.generate([PROMPT] * N, params)], llm.stats()


@pytest.fixture(scope="module")
def samples(tiny_model):
    return _sample(tiny_model), _sample(tiny_model, speculative_config=SPEC)


def test_first_tokens_are_distributed_as_without_speculation(samples):
    (plain, plain_stats), (spec, spec_stats) = samples
    assert plain_stats["spec_decode_num_drafts"] == 0
    assert [o[0] for o in spec] == [o[0] for o in plain]  # the first token is sampled as before
    for position, token in LOOP.items():
        without = sum(o[position] == token for o in plain) / N
        with_spec = sum(o[position] == token for o in spec) / N
        assert abs(with_spec - without) < BOUND, (position, without, with_spec)
    # rejection sampling decided: many drafts, some but not all accepted
    assert 0 < spec_stats["spec_decode_num_accepted_tokens"] < spec_stats["spec_decode_num_draft_tokens"] / 2


def test_seeded_output_is_deterministic(tiny_model, samples):
    (_, _), (spec, _) = samples
    again, _ = _sample(tiny_model, speculative_config=SPEC)
    assert again == spec
