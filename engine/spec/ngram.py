"""The n-gram (prompt lookup) proposer: drafts from the sequence's own history.

For a sequence t[0..L) (prompt + output), find the longest n in
[min_n, max_n] such that its last n tokens t[L-n..L) occurred earlier, ending
at some e < L-1; the draft is up to k tokens that followed the earliest such
occurrence, t[e+1 .. e+1+k). Same rule as vLLM's `NgramProposer` (longest
match, earliest position among the longest), written here as one vectorised
pass instead of a KMP loop:

    pad t on the left with max_n - 1 fillers, window w[e] = t[e-max_n+1 .. e]
    eq[e, j] = t[e - j] == t[L - 1 - j]          j < max_n (suffix read backwards)
    match_len[e] = leading run of True in eq[e]   (cumprod, summed)

A repeated phrase in the prompt, or a greedy continuation that cycles (random
weights often do), gives drafts the target accepts. No model, no state: a
preempted or handed-over sequence drafts from its tokens like any other.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from epd.engine.request import Request

_PAD = -1  # never a token id


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int):
        assert 1 <= min_n <= max_n and num_speculative_tokens >= 1
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose_requests(self, requests: Sequence[Request]) -> list[list[int]]:
        """The proposers' interface (engine_core): a draft per request, from its tokens."""
        return [self.propose(r.all_token_ids) for r in requests]

    def propose(self, token_ids: Sequence[int], max_num_tokens: int | None = None) -> list[int]:
        """Up to min(k, `max_num_tokens`) draft tokens to follow `token_ids`; [] when
        no n-gram of length >= min_n recurs."""
        k = self.k if max_num_tokens is None else min(self.k, max_num_tokens)
        num_tokens = len(token_ids)
        if k <= 0 or num_tokens <= self.min_n:  # a match must end before the last token
            return []
        t = torch.tensor(token_ids, dtype=torch.long)
        max_n = min(self.max_n, num_tokens - 1)
        padded = torch.cat([torch.full((max_n - 1,), _PAD, dtype=torch.long), t[:-1]])
        windows = padded.unfold(0, max_n, 1)  # [L - 1, max_n]: window e ends at t[e], e < L - 1
        eq = windows.flip(1) == t[-max_n:].flip(0)  # [L - 1, max_n]: column j compares t[e - j], t[L - 1 - j]
        match_len = eq.int().cumprod(dim=1).sum(dim=1)  # [L - 1]
        best = int(match_len.max())
        if best < self.min_n:
            return []
        end = int((match_len >= best).nonzero()[0])  # earliest end of a longest match
        return list(token_ids[end + 1:end + 1 + k])
