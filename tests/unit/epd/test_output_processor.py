"""OutputProcessor, the one output path of the offline LLM and the server, on the
tiny checkpoint's tokenizer: engine outputs in, text, tokens, logprobs and
finish reasons out, however the tokens are grouped into outputs."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from epd.output_processor import OutputProcessor
from epd.transport.wire.sampling import SamplingParams, TokenLogprobs

PROMPT = [400, 401, 402]
TOKENS = [300 + 7 * i for i in range(20)]  # clear of the special tokens


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _full_text(tokenizer) -> str:
    return _decode(tokenizer, TOKENS)


def _logprobs(ids: list[int]) -> list[TokenLogprobs]:
    return [TokenLogprobs(t, -0.5 - i, 1, []) for i, t in enumerate(ids)]


def _feed(processor: OutputProcessor, group: int, finish_reason: str = "length") -> list:
    """TOKENS in outputs of `group` tokens each, with logprobs; the last output
    finishes with `finish_reason`. Returns the steps up to the finishing one."""
    steps = []
    for start in range(0, len(TOKENS), group):
        ids = TOKENS[start:start + group]
        last = start + group >= len(TOKENS)
        steps.append(processor.take(ids, _logprobs(TOKENS)[start:start + group], finish_reason if last else None))
        if steps[-1].finish_reason is not None:
            break
    return steps


@pytest.mark.parametrize("group", [1, 3, 20])
def test_the_text_is_the_whole_decode_however_the_tokens_are_grouped(tokenizer, group):
    processor = OutputProcessor(tokenizer, PROMPT, SamplingParams(max_tokens=20, logprobs=0))
    steps = _feed(processor, group)
    assert "".join(s.text for s in steps) == processor.text == _full_text(tokenizer)
    assert [t for s in steps for t in s.token_ids] == processor.token_ids == TOKENS
    assert [e.token_id for e in processor.logprobs] == TOKENS
    assert steps[-1].finish_reason == "length" == processor.finish_reason
    assert processor.stop_reason is None


@pytest.mark.parametrize("group", [1, 20])
@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_ends_text_tokens_and_logprobs_at_the_token_it_ends_in(tokenizer, group, include):
    full = _full_text(tokenizer)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip() and full.index(stop) > 0
    processor = OutputProcessor(tokenizer, PROMPT, SamplingParams(max_tokens=20, logprobs=0, stop=[stop],
                                                                  include_stop_str_in_output=include))
    steps = _feed(processor, group)  # the last output says "length": the stop string wins
    end = full.index(stop) + (len(stop) if include else 0)
    assert "".join(s.text for s in steps) == processor.text == full[:end]
    assert steps[-1].finish_reason == processor.finish_reason == "stop" and processor.stop_reason == stop
    assert 0 < len(processor.token_ids) < len(TOKENS) and processor.token_ids == TOKENS[:len(processor.token_ids)]
    through_stop = full[:full.index(stop) + len(stop)]  # the last token taken is the one the stop ends in
    assert _decode(tokenizer, processor.token_ids).startswith(through_stop)
    assert not _decode(tokenizer, processor.token_ids[:-1]).startswith(through_stop)
    assert [e.token_id for e in processor.logprobs] == processor.token_ids
    assert [t for s in steps for t in s.token_ids] == processor.token_ids


def test_text_that_may_begin_a_stop_string_is_held_back_until_the_end(tokenizer):
    full = _full_text(tokenizer)
    processor = OutputProcessor(tokenizer, PROMPT, SamplingParams(max_tokens=20, stop=[full + "never"]))
    steps = _feed(processor, 1)
    assert "".join(s.text for s in steps[:-1]) == ""  # every prefix of the text may begin the stop
    assert steps[-1].text == full and processor.finish_reason == "length"


def test_a_stop_token_names_itself_and_an_eos_does_not(tokenizer):
    named = OutputProcessor(tokenizer, PROMPT, SamplingParams(max_tokens=20, stop_token_ids=[TOKENS[2]]))
    named.take(TOKENS[:3], finish_reason="stop")
    assert named.finish_reason == "stop" and named.stop_reason == TOKENS[2]
    eos = OutputProcessor(tokenizer, PROMPT, SamplingParams(max_tokens=20))
    eos.take([TOKENS[0], tokenizer.eos_token_id], finish_reason="stop")
    assert eos.finish_reason == "stop" and eos.stop_reason is None
    assert eos.text == _decode(tokenizer, [TOKENS[0]])


def test_an_engine_failure_ends_the_sequence_and_releases_what_was_held(tokenizer):
    full = _full_text(tokenizer)
    processor = OutputProcessor(tokenizer, PROMPT, SamplingParams(max_tokens=20, stop=[full + "never"]))
    processor.take(TOKENS[:5])
    assert processor.text == "" and processor.finish_reason is None
    released = processor.finish("error")
    assert released == processor.text == _decode(tokenizer, TOKENS[:5])
    assert processor.finish_reason == "error" and processor.stop_reason is None


def test_the_first_prompt_logprobs_are_kept(tokenizer):
    processor = OutputProcessor(tokenizer, PROMPT, SamplingParams(max_tokens=20, prompt_logprobs=0))
    first, later = _logprobs(PROMPT[1:]), _logprobs([7, 8, 9])
    processor.take(TOKENS[:1], prompt_logprobs=first)
    processor.take(TOKENS[1:2], prompt_logprobs=later)  # a resumed attempt scores a longer prompt
    assert processor.prompt_logprobs == first and processor.logprobs is None
