"""The n-gram proposer: the longest recurring suffix in [min_n, max_n], earliest
occurrence, up to k following tokens (vLLM's rule), checked against a plain
scan of every n and position."""
from __future__ import annotations

import random

import pytest

from epd.engine.spec.ngram import NgramProposer


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Longest n first; for it, the earliest earlier occurrence of the last n tokens."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):  # an occurrence that ends before the last token
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@pytest.mark.parametrize("tokens, k, min_n, max_n, expected", [
    ([1, 2, 3, 4, 2, 3], 4, 2, 3, [4, 2, 3]),  # vLLM's docstring example: [2, 3] matches, 3 tokens follow
    ([1, 2, 3, 4, 2, 3], 2, 2, 3, [4, 2]),  # k caps the draft
    ([1, 2, 3, 4, 5], 3, 1, 3, []),  # nothing recurs
    ([7, 7, 7, 7], 3, 2, 2, [7, 7]),  # an occurrence may overlap the suffix: the earliest, at 0
    ([5, 9, 1, 2, 8, 1, 2, 9, 1, 2], 2, 1, 3, [8, 1]),  # [9, 1, 2] beats [1, 2]: the longest match wins
    ([1, 2, 1, 2], 3, 3, 5, []),  # shorter than min_n + 1 recurrences: none
    ([3], 2, 1, 1, []),
])
def test_proposals(tokens, k, min_n, max_n, expected):
    assert NgramProposer(k, min_n, max_n).propose(tokens) == expected
    assert reference(tokens, k, min_n, max_n) == expected


def test_max_num_tokens_caps_the_draft():
    proposer = NgramProposer(4, 1, 2)
    assert proposer.propose([1, 2, 3, 1, 2], max_num_tokens=2) == [3, 1]
    assert proposer.propose([1, 2, 3, 1, 2], max_num_tokens=0) == []


def test_matches_the_plain_scan_on_random_sequences():
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        k, min_n = rng.randrange(1, 6), rng.randrange(1, 4)
        max_n = min_n + rng.randrange(0, 4)
        assert NgramProposer(k, min_n, max_n).propose(tokens) == reference(tokens, k, min_n, max_n), tokens
