"""The offline LLM's outputs carry what vLLM's do: `RequestOutput.prompt_logprobs`
(None first, then each prompt token's logprob, rank and top k, equal to transformers'
log-softmax on the same checkpoint) and `CompletionOutput.stop_reason` (the stop string
or stop token that ended a sequence; None for EOS and length)."""
from __future__ import annotations

import pytest
from testkit.hf_reference import hf_prompt_logits

from epd.transport.wire.sampling import SamplingParams

MESSAGES = [{"role": "user", "content": "Tell me about lighthouses."}]
K = 3


@pytest.fixture(scope="module")
def llm(tiny_model):
    from epd import LLM

    return LLM(tiny_model, num_kv_blocks=64, dtype="float32", device="cpu")


def test_prompt_logprobs_equal_transformers(llm, tiny_model):
    (out,) = llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=K))
    ids, ref_logits = hf_prompt_logits(tiny_model, MESSAGES, [])
    assert out.prompt_token_ids == ids
    steps = out.prompt_logprobs
    assert steps[0] is None and len(steps) == len(ids)
    ref = ref_logits.log_softmax(dim=-1)
    for i in range(1, len(ids)):
        row, step = ref[i - 1], steps[i]
        assert step.token_id == ids[i]
        assert abs(step.logprob - row[ids[i]].item()) < 1e-4, i
        assert step.rank == int((row > row[ids[i]]).sum()) + 1, i
        assert [t for t, _ in step.top] == row.topk(K).indices.tolist(), i
    (plain,) = llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=1))
    assert plain.prompt_logprobs is None


def test_stop_reason_names_the_stop_token_or_string(llm):
    (free,) = llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    tokens = free.outputs[0].token_ids
    assert free.outputs[0].finish_reason == "length" and free.outputs[0].stop_reason is None
    (by_token,) = llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                    stop_token_ids=[tokens[2]]))
    first = tokens.index(tokens[2])
    assert by_token.outputs[0].token_ids == tokens[:first + 1]
    assert (by_token.outputs[0].finish_reason, by_token.outputs[0].stop_reason) == ("stop", tokens[2])
    text = free.outputs[0].text
    stop = next(c for c in text if not c.isspace())  # random weights: any character the text has
    (by_string,) = llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop=[stop]))
    assert by_string.outputs[0].text == text[:text.index(stop)]
    assert (by_string.outputs[0].finish_reason, by_string.outputs[0].stop_reason) == ("stop", stop)
