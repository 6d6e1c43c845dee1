"""Qwen3.5 with images through the offline `LLM` (Qwen3-VL's tower without deepstack, M-RoPE
positions, the hybrid decoder over the state cache) gives transformers' greedy tokens and top-5
logprobs (float32) on the mixed batch: text, one and two images, prompts over several chunks.
The dense preset only: the MoE one has the same tower and positions (its decoder is tested in
test_qwen3_5_llm.py)."""
from __future__ import annotations

import pytest
import torch
from testkit.hf_reference import assert_greedy_matches, hf_inputs
from testkit.media import MIXED_BATCH, images_of

from epd.transport.wire.sampling import SamplingParams

NUM_TOKENS = 5


@torch.no_grad()
def _reference(model, model_dir: str, messages: list[dict]) -> tuple[list[int], list[list[int]], torch.Tensor]:
    """transformers' greedy (tokens, top-5 ids per token, their logprobs [NUM_TOKENS, 5])."""
    inputs = hf_inputs(model_dir, messages, images_of(messages))
    out = model.generate(**inputs, max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
    top = logprobs.topk(5)
    return out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), top.indices.tolist(), top.values


@pytest.mark.parametrize("qwen3_5_model", ["qwen3.5-tiny"], indirect=True)  # the tower is the same for MoE
def test_mixed_batch_with_images_equals_transformers(qwen3_5_model, qwen3_5_reference):
    from epd import LLM

    batch = MIXED_BATCH[:5]
    expected = [_reference(qwen3_5_reference, qwen3_5_model, c) for c in batch]
    llm = LLM(qwen3_5_model, max_num_batched_tokens=32, max_num_seqs=4, dtype="float32")
    outs = llm.chat(batch, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5))
    assert_greedy_matches(outs, expected)
    assert any(len(out.prompt_token_ids) > 32 for out in outs)  # some prompt went over several chunks
