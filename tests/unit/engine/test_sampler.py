"""Sampler: greedy, filters, seeds, penalties, logprobs, banned ids."""
from __future__ import annotations

import math

import pytest
import torch

from epd.engine.sampler import (Sampler, SamplingBatch, SamplingInput, apply_penalties,
                            apply_top_k_top_p, make_generator, token_counts)
from epd.transport.wire.sampling import SamplingParams

VOCAB = 1000
PROBS = [0.4, 0.3, 0.15, 0.1, 0.05]  # crafted head; the rest of the vocab is ~0


def sample(logits: torch.Tensor, inputs: list[SamplingInput]):
    return Sampler()(logits, SamplingBatch.from_inputs(inputs))


def crafted_logits(num_seqs: int, vocab: int = 50) -> torch.Tensor:
    """[num_seqs, vocab] logits whose softmax is PROBS, then a tail of 1e-9 each."""
    probs = torch.full((vocab,), 1e-9)
    probs[:len(PROBS)] = torch.tensor(PROBS)
    return probs.log().expand(num_seqs, vocab).clone()


def counts_of(token_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(token_ids, minlength=vocab)


def test_greedy_is_argmax_on_fast_path():
    torch.manual_seed(0)
    logits = torch.randn(8, VOCAB, dtype=torch.bfloat16)
    batch = SamplingBatch.from_inputs([SamplingInput(SamplingParams(temperature=0))] * 8)
    assert batch.is_all_greedy and not batch.has_penalties and batch.banned_ids is None
    out = Sampler()(logits, batch)
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.float().argmax(-1))
    assert out.logprobs is None


def test_greedy_rows_in_a_mixed_batch_and_top_k_1():
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB)
    inputs = [SamplingInput(SamplingParams(temperature=0)),
              SamplingInput(SamplingParams(temperature=1.5)),
              SamplingInput(SamplingParams(temperature=1.0, top_k=1)),
              SamplingInput(SamplingParams(temperature=0.7, top_k=1, top_p=0.5)),
              SamplingInput(SamplingParams(temperature=0), generator=make_generator(3)),
              SamplingInput(SamplingParams(temperature=2.0, top_k=1), generator=make_generator(4))]
    token_ids = sample(logits, inputs).token_ids
    expected = logits.argmax(-1)
    for row in (0, 2, 3, 4, 5):
        assert token_ids[row] == expected[row]


def seeded_run(seed: int, row: int, neighbours: list[SamplingInput], steps: int = 10):
    """Tokens of one seeded request over `steps` steps, placed at `row` among neighbours."""
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=500, seed=seed)
    generator = make_generator(seed)
    torch.manual_seed(1234)
    logits_per_step = [torch.randn(VOCAB) for _ in range(steps)]
    torch.manual_seed(row + 7 * len(neighbours))  # the default generator varies too
    tokens = []
    for logits_row in logits_per_step:
        inputs = list(neighbours)
        inputs.insert(row, SamplingInput(params, generator=generator))
        logits = torch.randn(len(inputs), VOCAB) * 3
        logits[row] = logits_row
        tokens.append(int(sample(logits, inputs).token_ids[row]))
    return tokens


def test_seed_is_reproducible_across_batch_compositions():
    others = [SamplingInput(SamplingParams(temperature=0)),
              SamplingInput(SamplingParams(temperature=1.3, top_p=0.5, min_p=0.1)),
              SamplingInput(SamplingParams(temperature=1.0, seed=9), generator=make_generator(9)),
              SamplingInput(SamplingParams(top_k=3, repetition_penalty=1.3, frequency_penalty=0.5),
                            prompt_token_ids=[1, 2, 3], output_token_ids=[4, 4]),
              SamplingInput(SamplingParams(logprobs=2), banned_token_ids=[5, 6])]
    alone = seeded_run(42, 0, [])
    assert seeded_run(42, 0, others) == alone
    assert seeded_run(42, 3, others) == alone
    assert seeded_run(42, 1, others[:2]) == alone
    assert seeded_run(43, 0, others) != alone  # another seed, other tokens


def test_filters_never_sample_outside_the_allowed_set():
    num = 2000
    logits = crafted_logits(num)
    cases = [(dict(top_k=2), {0, 1}),
             (dict(top_p=0.65), {0, 1}),
             (dict(top_p=0.8), {0, 1, 2}),
             (dict(top_p=1e-9), {0}),  # 1 - p rounds to 1.0: the top token must survive
             (dict(min_p=0.3), {0, 1, 2}),  # p >= 0.3 * 0.4 = 0.12
             (dict(top_k=4, top_p=0.95, min_p=0.2), {0, 1, 2, 3})]
    torch.manual_seed(0)
    for kwargs, allowed in cases:
        token_ids = sample(logits, [SamplingInput(SamplingParams(**kwargs))] * num).token_ids
        assert set(token_ids.tolist()) == allowed, kwargs  # nothing else, and all of it


def test_top_p_always_keeps_the_top_token():
    logits = torch.tensor([PROBS, PROBS[::-1]]).log()
    kept = apply_top_k_top_p(logits, None, torch.tensor([1e-9, 1e-9])).isfinite()
    assert kept.tolist() == [[True] + [False] * 4, [False] * 4 + [True]]


def test_filtered_rows_renormalize():
    num = 20000
    torch.manual_seed(1)
    token_ids = sample(crafted_logits(num), [SamplingInput(SamplingParams(top_k=2))] * num).token_ids
    freq = counts_of(token_ids, 50)[:2].float() / num
    assert torch.allclose(freq, torch.tensor([4 / 7, 3 / 7]), atol=0.02)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_matches_the_tempered_distribution(temperature):
    num, vocab = 20000, 50
    torch.manual_seed(2)
    params = SamplingParams(temperature=temperature)
    token_ids = sample(crafted_logits(num, vocab), [SamplingInput(params)] * num).token_ids
    p = torch.tensor(PROBS) ** (1 / temperature)
    expected = p / (p.sum() + (vocab - len(PROBS)) * 1e-9 ** (1 / temperature))
    freq = counts_of(token_ids, vocab)[:len(PROBS)].float() / num
    assert torch.allclose(freq, expected, atol=0.015), (freq, expected)


def test_seeded_rows_match_their_distribution():
    """Per-row generators still sample from the right distribution."""
    num = 4000
    logits = crafted_logits(num)
    inputs = [SamplingInput(SamplingParams(seed=i), generator=make_generator(i)) for i in range(num)]
    freq = counts_of(sample(logits, inputs).token_ids, 50)[:len(PROBS)].float() / num
    assert torch.allclose(freq, torch.tensor(PROBS), atol=0.03)


def test_token_counts():
    ids = torch.tensor([[3, 1, 3, -1], [-1, -1, -1, -1]])
    counts = token_counts(ids, 5)
    assert counts.tolist() == [[0, 1, 0, 2, 0], [0, 0, 0, 0, 0]]


def test_apply_penalties_matches_the_formulas():
    torch.manual_seed(3)
    vocab = 12
    logits = torch.randn(3, vocab) * 2
    prompt = [[0, 1, 2, 2], [5], []]
    output = [[2, 3, 3, 3], [5, 6, 6], [7]]
    presence, frequency, repetition = [0.5, -0.3, 0.0], [0.25, 1.0, 0.0], [1.5, 0.8, 1.0]

    def pad(rows):
        width = max(len(r) for r in rows)
        return torch.tensor([r + [-1] * (width - len(r)) for r in rows])

    got = apply_penalties(logits, pad(prompt), pad(output), torch.tensor(presence),
                          torch.tensor(frequency), torch.tensor(repetition))
    for i in range(3):
        for t in range(vocab):
            x = logits[i, t].item()
            if t in prompt[i] or t in output[i]:
                x = x / repetition[i] if x > 0 else x * repetition[i]
            count = output[i].count(t)
            x -= frequency[i] * count + presence[i] * (count > 0)
            assert got[i, t].item() == pytest.approx(x, abs=1e-6), (i, t)
    assert torch.equal(got[2, :7], logits[2, :7])  # neutral row: untouched


def test_penalties_steer_greedy_rows():
    logits = torch.tensor([[5.0, 4.9, 0.0, 0.0]]).repeat(3, 1)
    inputs = [SamplingInput(SamplingParams(temperature=0), prompt_token_ids=[0], output_token_ids=[0]),
              SamplingInput(SamplingParams(temperature=0, repetition_penalty=1.2),
                            prompt_token_ids=[0]),
              SamplingInput(SamplingParams(temperature=0, presence_penalty=2.0, frequency_penalty=2.0),
                            output_token_ids=[0, 0, 1, 1])]
    # 5/1.2 < 4.9;  5-2*2-2 = -1, 4.9-2*2-2 = -1.1, 0 untouched
    assert sample(logits, inputs).token_ids.tolist() == [0, 1, 2]


def test_logprobs_are_raw_model_log_softmax():
    torch.manual_seed(4)
    logits = torch.randn(4, VOCAB, dtype=torch.bfloat16)
    inputs = [SamplingInput(SamplingParams(temperature=0.7, top_k=5, logprobs=3,
                                           presence_penalty=1.0), output_token_ids=[1, 2]),
              SamplingInput(SamplingParams(temperature=0)),
              SamplingInput(SamplingParams(temperature=0, logprobs=0)),
              SamplingInput(SamplingParams(logprobs=20), banned_token_ids=[7])]
    out = sample(logits, inputs)
    expected = logits.float().log_softmax(-1)
    assert out.logprobs[1] is None
    assert out.logprobs[2].top == []
    assert out.logprobs[2].rank == 1
    for row, k in ((0, 3), (2, 0), (3, 20)):
        lp = out.logprobs[row]
        assert lp.token_id == out.token_ids[row]
        assert lp.logprob == pytest.approx(expected[row, lp.token_id].item(), abs=1e-5)
        assert lp.rank == int((expected[row] > expected[row, lp.token_id]).sum()) + 1
        values, indices = expected[row].topk(k)
        assert [t for t, _ in lp.top] == indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-5)
        assert all(math.isfinite(v) for _, v in lp.top)


def test_banned_tokens_are_never_sampled():
    num = 2000
    logits = crafted_logits(num)
    banned = [0, 1, 2]
    inputs = [SamplingInput(SamplingParams(temperature=0), banned_token_ids=banned),
              *[SamplingInput(SamplingParams(), banned_token_ids=banned)] * (num - 1)]
    torch.manual_seed(5)
    token_ids = sample(logits, inputs).token_ids
    assert token_ids[0] == 3  # greedy: best token not banned
    assert not set(token_ids.tolist()) & set(banned)
    assert {3, 4} <= set(token_ids.tolist())


def test_large_batch_builds_tensors_only_where_needed():
    vocab = 32000
    inputs = [SamplingInput(SamplingParams(temperature=0), prompt_token_ids=list(range(4000)),
                            output_token_ids=list(range(100)))] * 256
    batch = SamplingBatch.from_inputs(inputs)
    assert batch.is_all_greedy and not batch.has_penalties and batch.top_p is None
    inputs[0] = SamplingInput(SamplingParams(repetition_penalty=1.1), prompt_token_ids=[1, 2],
                              output_token_ids=[3])
    batch = SamplingBatch.from_inputs(inputs)
    assert batch.penalty_rows.tolist() == [0]  # only the penalized row is processed
    assert batch.prompt_token_ids.shape == (1, 2)
    logits = torch.randn(256, vocab)
    out = Sampler()(logits, batch)
    assert torch.equal(out.token_ids[1:], logits[1:].argmax(-1))
