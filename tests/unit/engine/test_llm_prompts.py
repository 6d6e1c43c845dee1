"""`LLM.generate` takes vLLM's prompt forms: a str, a list of token ids, TextPrompt
(`{"prompt": str}`) and TokensPrompt (`{"prompt_token_ids": [...]}`) dicts, one or a
list of them; a malformed prompt is a ValueError naming it, before any work."""
from __future__ import annotations

import pytest

from epd.transport.wire.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
IDS = [[5, 6, 7, 8, 9], [12, 13, 14]]


@pytest.fixture(scope="module")
def llm(tiny_model):
    from epd import LLM

    return LLM(tiny_model, num_kv_blocks=64, dtype="float32", device="cpu")


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_tokens_prompt_dicts_generate_what_token_lists_do(llm):
    want = _tokens(llm.generate(IDS, GREEDY))
    assert [len(t) for t in want] == [4, 4]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in IDS], GREEDY)
    assert _tokens(outputs) == want
    assert [o.prompt_token_ids for o in outputs] == IDS
    assert _tokens(llm.generate({"prompt_token_ids": IDS[1]}, GREEDY)) == want[1:]  # one dict, not in a list


def test_text_prompt_dicts_generate_what_strings_do(llm):
    want = _tokens(llm.generate(["a b c", "d e"], GREEDY))
    assert _tokens(llm.generate([{"prompt": "a b c"}, {"prompt": "d e"}], GREEDY)) == want
    assert _tokens(llm.generate({"prompt": "d e"}, GREEDY)) == want[1:]


@pytest.mark.parametrize("prompt, words", [
    ({"prompt_token_ids": ["a", "b"]}, "token ids"),
    ({"prompt_token_ids": []}, "non-empty"),
    ({"prompt_token_ids": [1, 10 ** 9]}, "token ids in [0,"),
    ([1.5, 2.0], "token ids"),
    ({"text": "hi"}, "'prompt_token_ids'"),
    ({"prompt": "hi", "multi_modal_data": {"image": b""}}, "LLM.chat"),
])
def test_a_malformed_prompt_is_a_value_error(llm, prompt, words):
    before = llm.stats()
    with pytest.raises(ValueError) as err:
        llm.generate([[5, 6], prompt], GREEDY)
    assert words in str(err.value)
    assert not llm.engine.has_unfinished() and llm.stats() == before  # nothing was added
