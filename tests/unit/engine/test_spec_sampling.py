"""Speculative verification (engine/spec/sampling.py): the emitted tokens follow the target.

The first-token tests compute the distribution exactly from the sampler's own
acceptance and residual rules; the chain tests sample many sequences with a
fixed seed and bound a chi-square statistic (deterministic given the seed), and
show the same bound rejects a sampler that ignores the target.
"""
from __future__ import annotations

import pytest
import torch

from epd.engine.sampler import Sampler, SamplingBatch, SamplingInput, make_generator, sampling_probs
from epd.engine.spec.sampling import (DraftBatch, SpecSampler, acceptance_probs, draw_noise, greedy_verify,
                                      one_hot_probs, rejection_sample, residual_probs, verification_inputs)
from epd.engine.spec.sampling import verify as verify_flat
from epd.transport.wire.sampling import SamplingParams

V = 6


def _dist(values: list[float]) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    return t / t.sum()


# (target p, draft q): generic, q without mass where p has some, p without mass where
# q has some, q == p, a near-deterministic q, and disjoint supports.
PAIRS = [
    (_dist([0.3, 0.25, 0.2, 0.1, 0.1, 0.05]), _dist([0.1, 0.1, 0.1, 0.2, 0.2, 0.3])),
    (_dist([0.3, 0.25, 0.2, 0.1, 0.1, 0.05]), _dist([0.0, 0.5, 0.0, 0.5, 0.0, 0.0])),
    (_dist([0.0, 0.4, 0.0, 0.3, 0.3, 0.0]), _dist([0.2, 0.2, 0.2, 0.2, 0.1, 0.1])),
    (_dist([0.2, 0.2, 0.2, 0.2, 0.1, 0.1]), _dist([0.2, 0.2, 0.2, 0.2, 0.1, 0.1])),
    (_dist([0.05, 0.05, 0.6, 0.1, 0.1, 0.1]), _dist([0.001, 0.001, 0.001, 0.001, 0.001, 0.995])),
    (_dist([0.5, 0.5, 0.0, 0.0, 0.0, 0.0]), _dist([0.0, 0.0, 0.0, 0.0, 0.5, 0.5])),
]


def first_token_distribution(p: torch.Tensor, q: torch.Tensor | None, fixed_draft: int | None = None) -> torch.Tensor:
    """P(first emitted token = t), enumerated over the draft token with the sampler's rules:
    sum_d q(d) [a(d) 1{t = d} + (1 - a(d)) r(t)]."""
    drafts = torch.arange(V).unsqueeze(1) if fixed_draft is None else torch.tensor([[fixed_draft]])
    n = drafts.shape[0]
    target = p.expand(n, 2, V)  # k = 1: the draft's position and the bonus position
    if q is None:  # deterministic proposer: q is one-hot on the fixed draft
        weights = torch.ones(1)
        accept = acceptance_probs(target, None, drafts)[:, 0]
        residual = residual_probs(p.expand(n, V), one_hot_probs(drafts, V)[:, 0])
    else:
        weights = q
        accept = acceptance_probs(target, q.expand(n, 1, V), drafts)[:, 0]
        residual = residual_probs(p.expand(n, V), q.expand(n, V))
    emitted = torch.zeros(V)
    for i in range(n):
        d = int(drafts[i, 0])
        emitted[d] += weights[i] * accept[i]
        emitted += weights[i] * (1 - accept[i]) * residual[i]
    return emitted


@pytest.mark.parametrize("p, q", PAIRS)
def test_first_token_follows_the_target_exactly(p, q):
    assert torch.allclose(first_token_distribution(p, q), p, atol=1e-6)


@pytest.mark.parametrize("p, _", PAIRS)
@pytest.mark.parametrize("draft", range(V))
def test_first_token_follows_the_target_with_a_deterministic_proposer(p, _, draft):
    got = first_token_distribution(p, None, fixed_draft=draft)
    assert torch.allclose(got, p, atol=1e-6)
    # one-hot q passed explicitly is the same rule
    explicit = first_token_distribution(p, one_hot_probs(torch.tensor([[draft]]), V)[0, 0], fixed_draft=None)
    assert torch.allclose(explicit, p, atol=1e-6)


def test_the_rules_would_catch_a_wrong_sampler():
    """The exact check is not vacuous: accepting every draft gives q, not p."""
    p, q = PAIRS[0]
    assert not torch.allclose(q, p, atol=1e-3)
    p_zero_where_q_has_mass, q2 = PAIRS[2]
    accept = acceptance_probs(p_zero_where_q_has_mass.expand(V, 2, V), q2.expand(V, 1, V),
                              torch.arange(V).unsqueeze(1))[:, 0]
    assert accept[0] == 0 and accept[2] == 0 and accept[1] == 1  # p = 0 never accepted, p >= q always


def test_rejection_sample_applies_exactly_those_rules():
    """Given its noise, the sampler accepts iff u < a(d) and draws the last token from
    the residual at the first rejection (or p after the last draft)."""
    p0, p1, p2 = _dist([0.1, 0.5, 0.1, 0.1, 0.1, 0.1]), _dist([0.4, 0.1, 0.1, 0.2, 0.1, 0.1]), _dist([1, 1, 1, 1, 1, 5])
    target = torch.stack([p0, p1, p2]).unsqueeze(0).repeat(3, 1, 1)  # [3 seqs, k + 1 = 3, V]
    q = torch.stack([_dist([0.1, 0.8, 0.02, 0.02, 0.03, 0.03]), _dist([0.1, 0.1, 0.1, 0.5, 0.1, 0.1])])
    drafts = DraftBatch(torch.tensor([[1, 3]] * 3), torch.tensor([2, 2, 2]), q.unsqueeze(0).repeat(3, 1, 1))
    a = acceptance_probs(target, drafts.probs, drafts.token_ids)[0]  # a(1) = 0.5 / 0.8, a(3) = 0.2 / 0.5
    eps = 1e-4
    uniforms = torch.tensor([[a[0] - eps, a[1] - eps],  # both accepted -> bonus from p2
                             [a[0] - eps, a[1] + eps],  # second rejected -> residual of p1, q1
                             [a[0] + eps, 0.0]])  # first rejected -> residual of p0, q0
    out = rejection_sample(target, drafts, uniforms, torch.ones(3, V))  # Exp = 1: the race picks the mode
    assert out.num_emitted.tolist() == [3, 2, 1]
    assert out.token_ids[0].tolist() == [1, 3, int(p2.argmax())]
    assert out.token_ids[1].tolist() == [1, int(residual_probs(p1, q[1]).argmax()), -1]
    assert out.token_ids[2].tolist() == [int(residual_probs(p0, q[0]).argmax()), -1, -1]


def sample_chains(target: torch.Tensor, draft: torch.Tensor | None, num_seqs: int, length: int,
                  k: int, seed: int, accept_all: bool = False) -> torch.Tensor:
    """[num_seqs, length] tokens of a Markov chain with transitions `target` [V, V], decoded
    speculatively from token 0 with k drafts per step from `draft` (None: the argmax of
    the target's row shifted by one, a deterministic and often wrong proposer)."""
    vocab = target.shape[0]
    torch.manual_seed(seed)
    drafter = torch.Generator().manual_seed(seed + 1)
    seqs = [[0] for _ in range(num_seqs)]
    while min(len(s) for s in seqs) < length + 1:
        last = torch.tensor([s[-1] for s in seqs])
        ids, probs = [], []
        for _ in range(k):  # each draft continues the previous one
            if draft is None:
                nxt = (target[last].argmax(-1) + 1) % vocab
            else:
                probs.append(draft[last])
                nxt = torch.multinomial(draft[last], 1, generator=drafter).squeeze(1)
            ids.append(nxt)
            last = nxt
        ids_t = torch.stack(ids, dim=1)  # [num_seqs, k]
        prev = torch.cat([torch.tensor([s[-1] for s in seqs]).unsqueeze(1), ids_t], dim=1)  # [num_seqs, k + 1]
        drafts = DraftBatch(ids_t, torch.full((num_seqs,), k), torch.stack(probs, 1) if probs else None)
        target_probs = target[prev]  # [num_seqs, k + 1, V]
        if accept_all:  # a broken verifier: every draft kept
            out_ids, num = torch.cat([ids_t, ids_t[:, :1]], 1), torch.full((num_seqs,), k + 1)
        else:
            uniforms, exps = draw_noise([None] * num_seqs, drafts, vocab, torch.device("cpu"))
            out = rejection_sample(target_probs, drafts, uniforms, exps)
            out_ids, num = out.token_ids, out.num_emitted
        for s, row, n in zip(seqs, out_ids.tolist(), num.tolist()):
            s.extend(row[:n])
    return torch.tensor([s[1:length + 1] for s in seqs])


def chi_square_of_paths(paths: torch.Tensor, target: torch.Tensor) -> float:
    """Pearson's statistic of the observed paths against the chain's path probabilities."""
    vocab, length = target.shape[0], paths.shape[1]
    index = torch.zeros(paths.shape[0], dtype=torch.int64)
    for j in range(length):
        index = index * vocab + paths[:, j]
    observed = torch.bincount(index, minlength=vocab ** length).double()
    expected = torch.ones(1, dtype=torch.float64)
    prev = torch.zeros(1, dtype=torch.int64)
    for _ in range(length):  # expected[path] = prod P[prev, next]
        expected = (expected.unsqueeze(1) * target.double()[prev]).reshape(-1)
        prev = torch.arange(vocab).repeat(len(prev))
    expected = expected * paths.shape[0]
    return float(((observed - expected) ** 2 / expected).sum())


TARGET = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6], [0.3, 0.4, 0.3]])
DRAFT = torch.tensor([[0.0, 0.5, 0.5], [0.8, 0.2, 0.0], [0.3, 0.4, 0.3]])  # zeros where the target has mass
# 26 degrees of freedom (27 paths of 3 tokens): P(chi2 > 60) < 2e-4; the seed fixes the value.
CHI2_BOUND = 60.0


@pytest.mark.parametrize("draft", [DRAFT, None], ids=["sampled-draft", "deterministic-draft"])
def test_speculative_chains_follow_the_target(draft):
    paths = sample_chains(TARGET, draft, num_seqs=20_000, length=3, k=3, seed=0)
    assert chi_square_of_paths(paths, TARGET) < CHI2_BOUND


def test_the_chain_check_rejects_a_verifier_that_keeps_every_draft():
    paths = sample_chains(TARGET, DRAFT, num_seqs=20_000, length=3, k=3, seed=0, accept_all=True)
    assert chi_square_of_paths(paths, TARGET) > 10 * CHI2_BOUND


def verify(logits: torch.Tensor, inputs: list[SamplingInput], drafts: list[list[int]],
           draft_probs: torch.Tensor | None = None):
    batch = SamplingBatch.from_inputs(verification_inputs(inputs, drafts))
    return SpecSampler()(logits, batch, DraftBatch.from_lists(drafts, draft_probs))


def test_greedy_verification_equals_greedy_decoding_with_penalties():
    """Greedy rows keep drafts while they equal the argmax of the processed logits, then
    emit it: token for token what the plain sampler gives one step at a time, with
    penalties that count the accepted drafts."""
    torch.manual_seed(0)
    vocab, k = 40, 4
    logits = torch.randn(3, k + 1, vocab)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, frequency_penalty=1.5),
              SamplingParams(temperature=0, repetition_penalty=1.3)]
    inputs = [SamplingInput(p, prompt_token_ids=[1, 2, 3], output_token_ids=[4, 5]) for p in params]
    # the plain sampler's greedy tokens at every position, feeding each back as output
    expected = []
    for i, x in enumerate(inputs):
        out, row = list(x.output_token_ids), []
        for j in range(k + 1):
            step = SamplingInput(x.params, x.prompt_token_ids, out)
            token = int(Sampler()(logits[i, j:j + 1], SamplingBatch.from_inputs([step])).token_ids[0])
            row.append(token)
            out = out + [token]
        expected.append(row)
    drafts = [expected[0][:k], expected[1][:2] + [(expected[1][2] + 1) % vocab, 0], []]
    out = verify(logits, inputs, drafts)
    assert out.num_emitted.tolist() == [k + 1, 3, 1]
    assert out.token_ids[0].tolist() == expected[0]
    assert out.token_ids[1].tolist() == expected[1][:3] + [-1, -1]
    assert out.token_ids[2].tolist() == [expected[2][0], -1, -1, -1, -1]
    # a step where nobody drafted is a plain decode step
    plain = verify(logits[:, :1], inputs, [[], [], []])
    assert plain.num_emitted.tolist() == [1, 1, 1] and plain.token_ids[:, 0].tolist() == [r[0] for r in expected]
    sampled = verify(logits[:, :1], [SamplingInput(SamplingParams(temperature=1.0, top_k=1))] * 3, [[], [], []])
    assert sampled.token_ids[:, 0].tolist() == logits[:, 0].argmax(-1).tolist()
    # greedy_verify is the same rule on a bare argmax
    assert greedy_verify(torch.tensor([[7, 8, 9]]), DraftBatch.from_lists([[7, 1]])).token_ids.tolist() == [[7, 8, -1]]


def test_seeded_sequence_ignores_its_neighbours():
    torch.manual_seed(0)
    vocab = 30
    logits = torch.randn(1, 4, vocab)
    params = SamplingParams(temperature=0.8, top_k=20, seed=7)

    def run(neighbours: list[tuple[SamplingInput, list[int]]], row: int) -> list[int]:
        mine = (SamplingInput(params, generator=make_generator(7)), [3, 4, 5])
        pairs = neighbours[:row] + [mine] + neighbours[row:]
        max_k = max(len(d) for _, d in pairs)
        full = torch.randn(len(pairs), max_k + 1, vocab)
        full[row, :4] = logits[0]
        out = verify(full, [x for x, _ in pairs], [d for _, d in pairs])
        return out.token_ids[row, :int(out.num_emitted[row])].tolist()

    alone = run([], 0)
    crowd = [(SamplingInput(SamplingParams(temperature=1.0)), [1, 2, 3, 4, 5, 6]),
             (SamplingInput(SamplingParams(temperature=0)), [2]),
             (SamplingInput(SamplingParams(temperature=1.2, seed=3), generator=make_generator(3)), [])]
    assert run(crowd, 1) == alone
    assert run(crowd, 3) == alone


def test_sampled_rows_follow_the_processed_target():
    """Temperature and top-k shape p_j: the first emitted token follows sampling_probs
    (a chi-square bound at a fixed seed), and tokens top-k removed never appear."""
    torch.manual_seed(1)
    vocab, num_seqs = 8, 6000
    row = torch.randn(vocab) * 2
    logits = row.expand(num_seqs, 2, vocab).clone()
    params = SamplingParams(temperature=0.7, top_k=4)
    inputs = [SamplingInput(params)] * num_seqs
    q = torch.softmax(torch.randn(vocab), -1)
    draws = torch.multinomial(q, num_seqs, replacement=True, generator=torch.Generator().manual_seed(2))
    drafts = [[int(d)] for d in draws]
    out = verify(logits, inputs, drafts, q.expand(num_seqs, 1, vocab).clone())
    p = sampling_probs(row.unsqueeze(0).clone(), SamplingBatch.from_inputs([SamplingInput(params)]))[0]
    counts = torch.bincount(out.token_ids[:, 0], minlength=vocab).double()
    kept = p > 0
    assert counts[~kept].sum() == 0 and int(kept.sum()) == 4
    expected = p.double()[kept] * num_seqs
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert chi2 < 25.0  # 3 degrees of freedom: P(chi2 > 25) < 2e-5


def test_flat_layout_gives_what_the_padded_one_gives():
    """The runner's layout (each sequence's rows where the step put them, a plain decode
    between them, per-draft probs or None) verifies exactly as the padded one: the same
    seeded draws, the same tokens."""
    torch.manual_seed(5)
    vocab = 16
    drafts = [[3, 4], [], [5, 6, 7]]
    params = [SamplingParams(temperature=0.9, seed=1), SamplingParams(temperature=0),
              SamplingParams(temperature=1.1, top_p=0.9, seed=2)]
    q = torch.softmax(torch.randn(2, vocab), -1)

    def inputs():
        return [SamplingInput(p, generator=make_generator(p.seed) if p.seed is not None else None) for p in params]

    padded_logits = torch.randn(3, 4, vocab)
    padded = SpecSampler()(padded_logits, SamplingBatch.from_inputs(
        verification_inputs(inputs(), drafts)), DraftBatch.from_lists(drafts, [q, None, None]))
    # flat: seq 0's 3 rows, a plain decode, seq 1's row, seq 2's 4 rows
    plain = SamplingInput(SamplingParams(temperature=0))
    rows = verification_inputs(inputs(), drafts)
    flat_inputs = rows[0:3] + [plain] + rows[4:5] + rows[8:12]
    flat_logits = torch.cat([padded_logits[0, :3], torch.randn(1, vocab), padded_logits[1, :1], padded_logits[2]])
    batch = SamplingBatch.from_inputs(flat_inputs)
    flat = verify_flat(Sampler.process(flat_logits, batch), batch, [0, 4, 5],
                       DraftBatch.from_lists(drafts, [q, None, None]))
    assert torch.equal(flat.token_ids, padded.token_ids) and torch.equal(flat.num_emitted, padded.num_emitted)


def test_a_draft_the_constraints_forbid_is_never_accepted():
    """allowed_token_ids (as a grammar mask would) zero p at the draft: sampled rows reject it
    every time and draw the replacement from the allowed ids only."""
    torch.manual_seed(6)
    vocab, num_seqs = 12, 400
    logits = torch.randn(num_seqs, 2, vocab)
    logits[:, :, 7] += 5.0  # the draft is the target's favourite, but not allowed
    params = SamplingParams(temperature=1.0, allowed_token_ids=[1, 2, 3])
    out = verify(logits, [SamplingInput(params)] * num_seqs, [[7]] * num_seqs)
    assert out.num_emitted.eq(1).all()
    assert set(out.token_ids[:, 0].tolist()) <= {1, 2, 3} and out.token_ids[:, 1].eq(-1).all()
