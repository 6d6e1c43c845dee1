"""The one acceptance function: greedy drafts keep their prefix equal to the
target's argmax and one more argmax; sampled drafts go to the rejection
sampler (engine/spec/sampling.py) on the same flat rows."""
from __future__ import annotations

import torch

from epd.engine.sampler import Sampler, SamplingBatch, SamplingInput, make_generator
from epd.engine.spec.sampling import DraftBatch, verify
from epd.engine.spec.verify import Draft, verify_drafts
from epd.transport.wire.sampling import SamplingParams


def _logits(argmax_rows: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.zeros(len(argmax_rows), vocab)
    logits[torch.arange(len(argmax_rows)), torch.tensor(argmax_rows)] = 5.0
    return logits


def test_greedy_keeps_the_agreeing_prefix_and_one_more():
    # rows: a plain decode (row 0), a draft of 3 (rows 1-4), a draft of 2 (rows 5-7)
    logits = _logits([6, 1, 2, 7, 4, 3, 5, 0])
    drafts = [Draft(1, (1, 2, 3)), Draft(5, (3, 5))]
    assert verify_drafts(logits, drafts) == [[1, 2, 7], [3, 5, 0]]  # a correction, then the bonus token
    assert verify_drafts(logits, [Draft(1, (0, 2, 7))]) == [[1]]  # the first draft token rejected
    assert verify_drafts(logits, []) == []


def _batch(seed: int, num_rows: int) -> SamplingBatch:
    generator = make_generator(seed)  # one sequence's rows share its generator
    params = SamplingParams(temperature=0.8, top_k=5, seed=seed)
    return SamplingBatch.from_inputs([SamplingInput(params, generator=generator) for _ in range(num_rows)])


def test_sampled_drafts_are_the_rejection_samplers():
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    draft = (3, 5, 1)
    ours = verify_drafts(Sampler.process(logits, _batch(7, 4)), [Draft(0, draft, is_greedy=False)], _batch(7, 4))
    out = verify(Sampler.process(logits, _batch(7, 4)), _batch(7, 4), [0], DraftBatch.from_lists([draft]))
    [theirs] = [ids[:n] for ids, n in zip(out.token_ids.tolist(), out.num_emitted.tolist())]
    assert ours == [theirs]
    [tokens] = ours
    assert 1 <= len(tokens) <= 4 and tokens[:-1] == list(draft[:len(tokens) - 1])
