"""IncrementalDetokenizer against a small byte-level BPE tokenizer trained here."""
from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from epd.detokenizer import IncrementalDetokenizer

CORPUS = [
    "héllo wörld 你好 🙂 the quick brown fox jumps over the lazy dog",
    "你好世界, こんにちは 🙂🙃👍 naïve café déjà vu — «quotes» ünïcödé",
    "Hello, world! Please STOP here. <tag> 1234 + 5678 = 6912",
    "数据 模型 推理 服务 🚀🔥 Ελληνικά русский текст",
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"], clean_up_tokenization_spaces=False)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table, used by the ByteLevel model."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_CHAR = bytes_to_unicode()


def byte_ids(tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte: splits every multi-byte character across tokens."""
    ids = tokenizer.convert_tokens_to_ids([BYTE_TO_CHAR[b] for b in text.encode("utf-8")])
    assert decode(tokenizer, ids) == text
    return ids


def stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random | None = None,
           finish: bool = True) -> list[str]:
    """Pushes ids one at a time (or in random-size groups); returns every chunk."""
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4) if rng else 1
        chunks.append(detok.push(ids[i:i + n]))
        i += n
    if finish:
        chunks.append(detok.finish())
    return chunks


def decode(tokenizer, ids, skip=True) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def random_sequences(tokenizer, rng: random.Random, count: int):
    """Realistic (encoded text, byte-split text) and garbage (uniform ids) sequences."""
    specials = tokenizer.all_special_ids
    words = " ".join(CORPUS).split()
    for _ in range(count):
        kind = rng.randrange(3)
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        if kind == 0:
            ids = tokenizer.encode(text)
        elif kind == 1:  # mixed: byte-split pieces between encoded ones
            ids = []
            for word in text.split():
                ids += byte_ids(tokenizer, word + " ") if rng.random() < 0.5 else tokenizer.encode(word + " ")
                if rng.random() < 0.1:
                    ids.append(rng.choice(specials))
        else:
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 30))]
        yield ids


def test_tokenizer_fixture_splits_characters(tokenizer):
    ids = byte_ids(tokenizer, "🙂")
    assert len(ids) == 4
    assert decode(tokenizer, ids[:2]).endswith("\ufffd")
    assert decode(tokenizer, ids) == "🙂"


@pytest.mark.parametrize("skip", [True, False])
def test_stream_concatenates_to_full_decode(tokenizer, skip):
    rng = random.Random(0)
    for ids in random_sequences(tokenizer, rng, 300):
        expected = decode(tokenizer, ids, skip)
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
        chunks = stream(detok, ids, rng if rng.random() < 0.5 else None)
        assert "".join(chunks) == expected, ids
        assert detok.text == expected
        if "\ufffd" not in expected:
            assert not any("\ufffd" in c for c in chunks), (ids, chunks)


def test_prompt_context_does_not_change_output_text(tokenizer):
    rng = random.Random(1)
    prompt = tokenizer.encode("<|im_start|>user 你好 🙂<|im_end|><|im_start|>assistant ")
    for ids in random_sequences(tokenizer, rng, 100):
        detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt)
        assert "".join(stream(detok, ids)) == decode(tokenizer, ids)


def test_split_emoji_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("ok ") + byte_ids(tokenizer, "🙂你") + tokenizer.encode(" end")
    detok = IncrementalDetokenizer(tokenizer)
    chunks = stream(detok, ids, finish=False)
    assert all("\ufffd" not in c for c in chunks)
    assert "🙂" in chunks  # released exactly when its 4th byte arrived
    assert chunks.count("") >= 3 + 2  # 3 bytes of 🙂 and 2 of 你 waited
    assert "".join(chunks) == "ok 🙂你 end"
    assert detok.finish() == ""


def test_incomplete_character_is_flushed_at_finish(tokenizer):
    ids = tokenizer.encode("hi ") + byte_ids(tokenizer, "🙂")[:2]
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(stream(detok, ids, finish=False)) == "hi "
    assert detok.finish() == "\ufffd"
    assert detok.text == decode(tokenizer, ids)


def test_special_tokens_skipped(tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("héllo") + [im_end] + tokenizer.encode(" wörld")
    assert "".join(stream(IncrementalDetokenizer(tokenizer), ids)) == "héllo wörld"
    kept = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(stream(kept, ids)) == "héllo<|im_end|> wörld"


def test_stop_string_split_across_tokens(tokenizer):
    ids = tokenizer.encode("Hello ") + byte_ids(tokenizer, "ST") + byte_ids(tokenizer, "OP") \
        + tokenizer.encode(" after the stop")
    detok = IncrementalDetokenizer(tokenizer, stop=["STOP"])
    chunks = stream(detok, ids)
    assert "".join(chunks) == "Hello "
    assert detok.stop_reason == "STOP"
    assert detok.text == "Hello "
    assert detok.push(tokenizer.encode("more")) == "" and detok.finish() == ""


def test_stop_string_inside_multibyte_split(tokenizer):
    ids = tokenizer.encode("a ") + byte_ids(tokenizer, "你好🙂 tail")
    detok = IncrementalDetokenizer(tokenizer, stop=["好🙂"])
    assert "".join(stream(detok, ids)) == "a 你"
    assert detok.stop_reason == "好🙂"


def test_stop_prefix_is_held_back_then_released(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, stop=["STOP"])
    assert detok.push(byte_ids(tokenizer, "abc ST")) == "abc "
    assert detok.push(byte_ids(tokenizer, "A")) == "STA"
    assert detok.push(byte_ids(tokenizer, " S")) == " "
    assert detok.finish() == "S"  # end of request: nothing can match any more
    assert detok.stop_reason is None
    assert detok.text == "abc STA S"


def test_include_stop_str_in_output(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, stop=["STOP"], include_stop_str_in_output=True)
    assert "".join(stream(detok, tokenizer.encode("Please STOP here."))) == "Please STOP"
    assert detok.stop_reason == "STOP"


def test_first_completed_stop_wins(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, stop=["here", "TOP", "P h"])
    assert "".join(stream(detok, byte_ids(tokenizer, "Please STOP here."))) == "Please S"
    assert detok.stop_reason == "TOP"


def test_earliest_stop_in_one_token_wins(tokenizer):
    ids = tokenizer.encode("héllo")
    assert len(ids) == 1  # both stops complete with the same token
    detok = IncrementalDetokenizer(tokenizer, stop=["llo", "é"])
    assert "".join(stream(detok, tokenizer.encode("a ") + ids)) == "a h"
    assert detok.stop_reason == "é"


def test_random_stops_never_leak(tokenizer):
    rng = random.Random(2)
    for ids in random_sequences(tokenizer, rng, 300):
        full = decode(tokenizer, ids)
        if len(full) < 3:
            continue
        start = rng.randrange(len(full) - 1)
        stop = full[start:start + rng.randint(1, 4)]
        detok = IncrementalDetokenizer(tokenizer, stop=[stop])
        chunks = stream(detok, ids, rng)
        expected = full[:full.find(stop)]
        assert "".join(chunks) == expected, (ids, stop)
        assert detok.stop_reason == stop
        for i in range(len(chunks)):
            assert stop not in "".join(chunks[:i + 1])
