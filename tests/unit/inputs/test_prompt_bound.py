"""`exceeds_tokens`: a prompt is refused as too long only when it surely is,
after tokenizing no more than the limit's worth of it (the tiny checkpoint's
tokenizer, pieces made small so every text is cut many times)."""
from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from epd.inputs.prompt import BOUNDARY_SLACK_TOKENS, exceeds_tokens

PIECE_CHARS = 97  # small and odd: cuts land everywhere, in words and in runs of spaces


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def _texts() -> list[str]:
    rng = random.Random(7)
    words = ["boats", "sail", "ünïcode", "日本語", "<|im_start|>", "  ", "\n\n", "12345", ",", "a" * 40, "🙂"]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(30, 400))) for _ in range(40)]
    # no spaces: cuts fall inside words and special tokens, where a cut adds tokens
    return texts + ["x" * 5000, " " * 3000, "word " * 900, "<|im_start|>" * 400, "ünï日本" * 500]


def test_never_refuses_a_prompt_that_fits(tokenizer):
    for text in _texts():
        num_tokens = len(tokenizer.encode(text, add_special_tokens=False))
        for limit in (num_tokens, num_tokens + 1, 2 * num_tokens):
            assert not exceeds_tokens(tokenizer, text, limit, piece_chars=PIECE_CHARS), (text[:80], limit)


def test_refuses_a_prompt_well_past_the_limit(tokenizer):
    for text in _texts():
        num_tokens = len(tokenizer.encode(text, add_special_tokens=False))
        num_pieces = len(text) // (PIECE_CHARS // 2) + 1  # every cut is at least half a piece on
        limit = num_tokens - BOUNDARY_SLACK_TOKENS * num_pieces - 1
        if limit > 0:
            assert exceeds_tokens(tokenizer, text, limit, piece_chars=PIECE_CHARS), (text[:80], limit)


def test_a_short_text_is_left_to_the_exact_count(tokenizer):
    assert not exceeds_tokens(tokenizer, "boats " * 10, 1, piece_chars=1000)


def test_stops_tokenizing_once_past_the_limit(tokenizer):
    """A text of a million pieces costs a few of them: counted by the calls the tokenizer gets."""
    calls = []

    class Counting:
        def encode(self, text, add_special_tokens):
            calls.append(len(text))
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    assert exceeds_tokens(Counting(), "boats sail " * 10_000_000, 100, piece_chars=1000)
    assert len(calls) <= 3 and sum(calls) <= 3000
