"""Prefix caching on Qwen3.5 (Gated DeltaNet layers carry per-request state): a hit resumes from
a state snapshot at a block boundary (engine/state_snapshots.py) and gives transformers' greedy
tokens and top-5 logprobs (float32), as a miss does, for a repeated prompt, a conversation's next
turn, a shared system prompt and a repeated image; preemption and abort leave the snapshots and
slots whole; a prefill engine's hit hands the right state over (e-p-d's hand-over, in process).
The dense preset: the MoE one runs the same state cache (test_qwen3_5_llm.py)."""
from __future__ import annotations

import pytest
import torch
from testkit.hf_reference import assert_greedy_matches, hf_inputs
from testkit.media import IMG_A, describe

from epd.engine.config import EngineConfig
from epd.engine.engine_core import EngineCore
from epd.engine.request import Request
from epd.transport.wire.messages import KVTransfer, decode_message
from epd.transport.wire.sampling import SamplingParams

NUM_TOKENS = 6
TOP5 = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
pytestmark = pytest.mark.parametrize("qwen3_5_model", ["qwen3.5-tiny"], indirect=True)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(16, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def _reference(model, ids: list[int] | None = None, inputs: dict | None = None):
    """transformers' greedy (tokens, top-5 ids per token, their logprobs [NUM_TOKENS, 5])."""
    inputs = inputs if inputs is not None else {"input_ids": torch.tensor([ids])}
    out = model.generate(**inputs, max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    top = torch.log_softmax(torch.cat(out.logits).float(), dim=-1).topk(5)
    return out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), top.indices.tolist(), top.values


def _assert_whole(core: EngineCore) -> None:
    """Every block, slot and snapshot index back or cached, none pending."""
    snapshots = core.scheduler.block_manager.snapshots
    assert snapshots.num_free + snapshots.num_cached == snapshots.num_snapshots == core.runner.snapshots.num_snapshots
    assert core.num_free_blocks() == core.num_blocks and core.runner.state_cache.usage == 0


@pytest.fixture(scope="module")
def llm(qwen3_5_model):
    from epd import LLM

    return LLM(qwen3_5_model, num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4, dtype="float32")


def _run(llm, ids: list[int], expected_hit: int, expected=None) -> list[int]:
    """`ids` through the LLM, its prefix hit `expected_hit` tokens; equal to `expected` (transformers')."""
    hits = llm.stats()["prefix_cache_hits"]
    (out,) = llm.generate([{"prompt_token_ids": ids}], TOP5)
    assert llm.stats()["prefix_cache_hits"] - hits == expected_hit, ids[:3]
    if expected is not None:
        assert_greedy_matches([out], [expected])
    return out.outputs[0].token_ids


def test_repeated_prompt_next_turn_and_shared_system_prompt_hit_and_equal_transformers(llm, qwen3_5_reference):
    prompt = _tokens(45, seed=1)
    expected = _reference(qwen3_5_reference, prompt)
    answer = _run(llm, prompt, 0, expected)
    _run(llm, prompt, 32, expected)  # resumed at its last full block (32 of 45 tokens skipped)
    turn2 = prompt + answer + [5, 6, 7, 8, 9]
    _run(llm, turn2, 48, _reference(qwen3_5_reference, turn2))  # from the latest snapshot past the prompt
    system = _tokens(40, seed=2)
    _run(llm, system + _tokens(10, seed=3), 0)
    _run(llm, system + _tokens(10, seed=4), 0)  # shares 32 tokens of KV, no state there yet: snapshotted now
    third = system + _tokens(10, seed=5)
    _run(llm, third, 32, _reference(qwen3_5_reference, third))
    assert llm.stats()["state_snapshot_hits"] == 3  # the repeat, the next turn, the third system prompt
    _assert_whole(llm.engine)


def test_a_repeated_image_hits_and_equals_transformers(llm, qwen3_5_model, qwen3_5_reference):
    messages = describe(IMG_A)
    expected = _reference(qwen3_5_reference, inputs=hf_inputs(qwen3_5_model, messages, [IMG_A]))
    hits = llm.stats()["prefix_cache_hits"]
    outs = [llm.chat(messages, TOP5)[0] for _ in range(2)]
    assert_greedy_matches(outs, [expected, expected])
    num_prompt_tokens = len(outs[0].prompt_token_ids)
    assert llm.stats()["prefix_cache_hits"] - hits == (num_prompt_tokens - 1) // 16 * 16 > 0  # the second's
    _assert_whole(llm.engine)


def test_preemption_and_abort_leave_the_snapshots_whole(qwen3_5_model, qwen3_5_reference):
    core = EngineCore(qwen3_5_model, EngineConfig.from_flat(num_kv_blocks=9, max_num_batched_tokens=32,
                                                            max_num_seqs=4, dtype="float32", device="cpu"))
    shared = _tokens(40, seed=6)
    prompts = {f"r{i}": shared + _tokens(9, seed=10 + i) for i in range(3)}
    got = {rid: [] for rid in prompts}
    for rid, ids in prompts.items():
        core.add_request(Request(rid, list(ids), TOP5))
    for num_steps in range(200):
        if not core.has_unfinished():
            break
        result = core.step()
        for update in result.updates:
            got[update.request_id] += result.logprobs[update.request_id]
        if num_steps == 6:
            assert core.abort(["r2"]) == ["r2"]
    assert core.stats()["num_preemptions"] > 0 and core.stats()["prefix_cache_hits"] > 0
    _assert_whole(core)
    for rid in ("r0", "r1"):
        tokens, top_ids, top_logprobs = _reference(qwen3_5_reference, prompts[rid])
        assert [lp.token_id for lp in got[rid]] == tokens, rid
        for lp, ids, values in zip(got[rid], top_ids, top_logprobs):
            assert [t for t, _ in lp.top] == ids, rid
            torch.testing.assert_close(torch.tensor([p for _, p in lp.top]), values, rtol=0, atol=1e-4)


def test_a_prefill_engines_hit_hands_the_right_state_over(qwen3_5_model, qwen3_5_reference):
    config = EngineConfig.from_flat(num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=4, dtype="float32",
                                    device="cpu")
    prefill, decode = EngineCore(qwen3_5_model, config, role="prefill"), EngineCore(qwen3_5_model, config, role="decode")
    prompt = _tokens(47, seed=8)
    expected = _reference(qwen3_5_reference, prompt)
    for rid in ("first", "again"):  # one after the other: the second resumes from the first's snapshot
        prefill.add_request(Request(rid, list(prompt), TOP5))
        got = []
        while prefill.has_unfinished():
            result = prefill.step()
            for update in result.updates:
                got += result.logprobs[rid]
                sent = KVTransfer(rid, prompt, update.new_token_ids[0], TOP5, [], [], *prefill.export_kv(rid),
                                  state=prefill.export_state(rid))
                msg = decode_message([bytes(f) for f in sent.to_wire()])
                request = Request(rid, list(prompt), TOP5)
                request.output_token_ids.append(update.new_token_ids[0])
                assert decode.add_prefilled(request, msg.k_blocks, msg.v_blocks, msg.draft_state, msg.state)
                assert prefill.release(rid)
        while decode.has_unfinished():
            result = decode.step()
            got += result.logprobs.get(rid, [])
        assert [lp.token_id for lp in got] == expected[0], rid
        for lp, ids, values in zip(got, expected[1], expected[2]):
            assert [t for t, _ in lp.top] == ids, rid
            torch.testing.assert_close(torch.tensor([p for _, p in lp.top]), values, rtol=0, atol=1e-4)
    assert prefill.stats()["prefix_cache_hits"] == 32  # the second: 32 of its 47 prompt tokens
    _assert_whole(prefill)
