"""Speculative decoding's acceptance: which draft tokens the target keeps.

One forward scores a decode's last token and its d draft tokens: d + 1 rows
of target logits, row i predicting the token after the draft's first i
tokens. `verify_drafts` is the one place that turns those rows into tokens:

    greedy: accept the longest prefix of the draft equal to the target's argmax
            row by row, then one more token, the argmax of the first row not
            accepted (the target's correction, or the bonus token when all d
            were). Exactly the tokens sequential greedy decoding gives.
    sampled (temperature > 0): rejection sampling, which keeps the target's
            distribution (engine/spec/sampling.py `verify`, on the same flat rows;
            tests/unit/engine/test_spec_sampled_engine.py end to end).

The rows must be what the sampler itself would read (`Sampler.process`):
logits with the grammar mask, banned ids, bias and penalties of row i's own
prefix applied, so a draft token the grammar refuses is never accepted and
verification never differs from decoding one token at a time.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from epd.engine.sampler import SamplingBatch
from epd.engine.spec.decode import accept_greedy
from epd.engine.spec.sampling import DraftBatch, verify


@dataclass(frozen=True)
class Draft:
    """One sequence's draft in a verification step."""

    row: int  # its first row in the target logits: the position of its last accepted token
    token_ids: tuple[int, ...]  # d proposed tokens; rows row .. row + d are its
    probs: torch.Tensor | None = None  # [d, vocab]: the proposer's distribution (None: n-gram, a point mass)
    is_greedy: bool = True


def verify_drafts(target_logits: torch.Tensor, drafts: Sequence[Draft],
                  batch: SamplingBatch | None = None) -> list[list[int]]:
    """Per draft, the tokens to append: its accepted prefix and one token of the
    target's (1..d + 1 tokens). `target_logits` [num_rows, vocab], processed;
    `batch` (the rows' SamplingBatch: temperatures, filters, generators) is needed
    only when a draft is not greedy, whose rows it edits in place."""
    if all(d.is_greedy for d in drafts):
        target = target_logits.argmax(dim=-1).tolist() if drafts else []  # one sync for the whole batch
        return [accept_greedy(target[d.row:d.row + len(d.token_ids) + 1], d.token_ids) for d in drafts]
    assert batch is not None, "sampled drafts need their rows' SamplingBatch"
    draft_batch = DraftBatch.from_lists([d.token_ids for d in drafts], [d.probs for d in drafts],
                                        device=target_logits.device)
    out = verify(target_logits, batch, [d.row for d in drafts], draft_batch)
    return [ids[:n] for ids, n in zip(out.token_ids.tolist(), out.num_emitted.tolist())]
