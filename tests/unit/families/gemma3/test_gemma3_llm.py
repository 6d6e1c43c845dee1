"""Gemma 3 through the offline `LLM` (the registry's family, the engine's scheduler and paged
KV cache, the encoder's vision side) gives transformers' greedy tokens and top-5 logprobs
(float32): the 8-request mixed batch (text, one and two images; most prompts longer than the
sliding window; an image's tokens attending to each other both ways) under a KV budget that
forces preemption and a token budget that prefills prompts over several chunks."""
from __future__ import annotations

import io

import pytest
import torch
from PIL import Image
from testkit.hf_reference import assert_greedy_matches
from testkit.media import MIXED_BATCH, images_of

from epd.transport.wire.sampling import SamplingParams

NUM_TOKENS = 8


def _template_messages(messages: list[dict]) -> list[dict]:
    return [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
             [p if p["type"] == "text" else {"type": "image"} for p in m["content"]]} for m in messages]


@torch.no_grad()
def _reference(model, processor, messages: list[dict]) -> tuple[list[int], list[list[int]], torch.Tensor]:
    """transformers' greedy (tokens, top-5 ids per token, their logprobs [NUM_TOKENS, 5])."""
    images = [Image.open(io.BytesIO(b)).convert("RGB") for b in images_of(messages)]
    text = processor.apply_chat_template(_template_messages(messages), add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, images=images or None, return_tensors="pt")  # token_type_ids: image tokens
    out = model.generate(**inputs, max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)  # [NUM_TOKENS, vocab]
    top = logprobs.topk(5)
    return out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), top.indices.tolist(), top.values


ON_GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs a CUDA GPU")])


@pytest.mark.parametrize("device", ["cpu", ON_GPU])  # cuda: the Triton attention backend and CUDA graphs
def test_mixed_batch_with_preemption_and_chunks_equals_transformers(gemma3_model, gemma3_reference, device):
    from epd import LLM

    model, processor = gemma3_reference
    expected = [_reference(model, processor, c) for c in MIXED_BATCH]
    llm = LLM(gemma3_model, num_kv_blocks=14, max_num_batched_tokens=24, max_num_seqs=8, dtype="float32",
              device=device)
    assert llm.engine.info.family == "gemma3"
    chunked = []
    original = llm.engine.scheduler.schedule

    def recording_schedule():
        out = original()
        chunked.extend(s.request_id for s in out.scheduled if 0 < s.end < s.request.num_prompt_tokens)
        return out

    llm.engine.scheduler.schedule = recording_schedule
    outs = llm.chat(MIXED_BATCH, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5))
    assert_greedy_matches(outs, expected, atol=1e-4 if device == "cpu" else 1e-3)
    assert llm.stats()["num_preemptions"] > 0, "the KV budget was meant to force preemption"
    assert chunked, "the token budget was meant to prefill a prompt over several chunks"
    assert llm.engine.num_free_blocks() == llm.engine.num_blocks


@pytest.mark.parametrize("kwargs, named", [({"do_pan_and_scan": 1}, "do_pan_and_scan"),
                                           ({"pan_and_scan_min_crop_size": 0}, "pan_and_scan_min_crop_size")])
def test_a_bad_pan_and_scan_setting_stops_the_llm_by_name(gemma3_model, kwargs, named):
    from epd import LLM

    with pytest.raises(ValueError, match=named):
        LLM(gemma3_model, dtype="float32", mm_processor_kwargs=kwargs)
