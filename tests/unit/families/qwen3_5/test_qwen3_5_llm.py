"""Qwen3.5 through the offline `LLM`: the engine's scheduler, paged KV and state
cache give transformers' greedy tokens and top-5 logprobs (float32) for text prompts of
different lengths run together (prefill chunks and decodes in one step), prompts prefilled over
several chunks through their state slots, and requests preempted and recomputed; every slot
and block is back at the end. What the engine cannot do yet for a model with per-request state
(speculation with a model of its own, LoRA) is refused by name; every serving mode and engine role is taken; KV is allocated for the
full-attention layers only, the block budget computed accordingly."""
from __future__ import annotations

import pytest
import torch
from testkit.hf_reference import assert_greedy_matches

from epd.transport.wire.sampling import SamplingParams

NUM_TOKENS = 6
PROMPT_LENS = (5, 19, 33, 47, 61)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(16, 1000, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@torch.no_grad()
def _reference(model, ids: list[int]) -> tuple[list[int], list[list[int]], torch.Tensor]:
    """transformers' greedy (tokens, top-5 ids per token, their logprobs [NUM_TOKENS, 5])."""
    out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
    top = logprobs.topk(5)
    return out.sequences[0, len(ids):].tolist(), top.indices.tolist(), top.values


# the dense preset: the MoE decoder over the same slots is test_qwen3_5_text_model.py's (CI time)
@pytest.mark.parametrize("qwen3_5_model", ["qwen3.5-tiny"], indirect=True)
def test_concurrent_chunked_preempted_requests_equal_transformers(qwen3_5_model, qwen3_5_reference):
    from epd import LLM

    prompts = _prompts()
    expected = [_reference(qwen3_5_reference, ids) for ids in prompts]
    llm = LLM(qwen3_5_model, num_kv_blocks=7, max_num_batched_tokens=24, max_num_seqs=4, dtype="float32",
              enable_prefix_caching=True)
    assert llm.engine.scheduler.block_manager.snapshots is not None  # prefix hits resume from state snapshots
    steps = []
    original = llm.engine.scheduler.schedule

    def recording_schedule():
        out = original()
        steps.append([(s.start, s.end, s.request.num_prompt_tokens) for s in out.scheduled])
        return out

    llm.engine.scheduler.schedule = recording_schedule
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                        SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5))
    assert_greedy_matches(outs, expected)
    assert llm.stats()["num_preemptions"] > 0, "the KV budget was meant to force preemption"
    assert any(0 < start and end < n for step in steps for start, end, n in step), "a prompt over several chunks"
    assert any(any(end > n for _, end, n in step) and any(end <= n for _, end, n in step) for step in steps), \
        "a step of decodes and prefill chunks together"
    assert llm.engine.num_free_blocks() == llm.engine.num_blocks
    assert llm.engine.runner.state_cache.usage == 0  # every slot back


@pytest.mark.parametrize("kwargs, named", [
    ({"speculative_config": {"method": "draft_model", "num_speculative_tokens": 2}},
     "method 'draft_model' is not supported yet .* use ngram"),  # n-gram is: test_qwen3_5_spec.py
])
def test_what_a_stateful_model_cannot_do_yet_is_refused_by_name(qwen3_5_model, kwargs, named):
    from epd import LLM

    if "speculative_config" in kwargs:  # the model drafting for itself: a draft that fits the target
        kwargs = {"speculative_config": {**kwargs["speculative_config"], "model": qwen3_5_model}}
    with pytest.raises(ValueError, match=named):
        LLM(qwen3_5_model, dtype="float32", **kwargs)


def test_serve_takes_every_mode_and_the_engine_every_role(qwen3_5_model):
    from epd.config import ServeConfig
    from epd.engine.config import EngineConfig
    from epd.engine.engine_core import EngineCore

    assert [ServeConfig(model=qwen3_5_model, mode=mode).mode.value for mode in ("e-p-d", "aggregated", "e-pd")] == \
        ["e-p-d", "aggregated", "e-pd"]  # the hand-over carries the state (test_qwen3_5_handover.py)
    for role in ("prefill", "decode"):
        core = EngineCore(qwen3_5_model, EngineConfig(dtype="float32", num_kv_blocks=8), role=role)
        assert core.runner.state_cache.num_slots == core.scheduler.config.max_num_seqs


@pytest.mark.parametrize("qwen3_5_model", ["qwen3.5-tiny"], indirect=True)
def test_kv_is_allocated_for_the_full_attention_layers_only(qwen3_5_model):
    from epd.engine.config import EngineConfig
    from epd.engine.engine_core import EngineCore
    from epd.engine.kv_cache_sizer import bytes_per_block
    from epd.engine.state_cache import bytes_per_slot, state_shapes

    core = EngineCore(qwen3_5_model, EngineConfig.from_flat(kv_cache_gb=0.01, max_num_seqs=4, dtype="float32",
                                                            enable_prefix_caching=False))  # no state snapshots
    model = core.runner.model
    cfg, num_full = model.cfg, model.cfg.layer_types.count("full_attention")
    assert 0 < num_full < cfg.num_layers and core.runner.kv_cache.shape[1] == num_full
    budget = int(0.01 * (1 << 30)) - 4 * bytes_per_slot(state_shapes(model), torch.float32)
    assert core.num_blocks == budget // bytes_per_block(num_full, cfg.num_kv_heads, cfg.head_dim, 16, torch.float32)
    every_layer = budget // bytes_per_block(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, torch.float32)
    assert core.num_blocks >= (cfg.num_layers // num_full) * every_layer  # the linear layers' share back to KV
