"""Speculative decoding on Qwen3.5 (dense and MoE): n-gram drafts verified over the Gated DeltaNet
state. The tokens are transformers' greedy ones (the engine's without speculation:
test_qwen3_5_llm.py) while drafts are both accepted and rejected and requests are preempted: a
rejected draft's state is rolled back to the last accepted token (engine/state_cache.py
roll_back), so a wrong rollback changes the tokens that follow; so too on a decode engine whose
state came from a prefill engine (e-p-d), with n-gram or MTP drafts. A draft's per-position
state checkpoints equal one-token-at-a-time decoding's states."""
from __future__ import annotations

import pytest
import torch
from testkit.engine_factories import cpu_llm

from epd.transport.wire.sampling import SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PHRASES = [[11, 12, 13, 14, 15] * 4, [300, 301, 302] * 6 + [300], [40, 41, 42, 43, 44, 45, 46] * 3 + [40, 41]]
NUM_TOKENS = 12


@torch.no_grad()
def _transformers_greedy(model, ids: list[int]) -> list[int]:
    out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS,
                         do_sample=False)
    return out[0, len(ids):].tolist()


PARAMS = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def workload(qwen3_5_model) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, the engine's greedy tokens for them without speculation). A prompt is a phrase,
    the start of the model's own continuation, the phrase again: the n-gram proposer drafts that
    continuation, which the model follows for a while and then leaves."""
    plain = cpu_llm(qwen3_5_model)
    first = [o.outputs[0].token_ids for o in plain.generate(PHRASES, PARAMS)]
    prompts = [phrase + out[:8] + phrase for phrase, out in zip(PHRASES, first)]
    return prompts, [o.outputs[0].token_ids for o in plain.generate(prompts, PARAMS)]


def test_ngram_greedy_tokens_are_transformers_with_drafts_accepted_and_rejected(qwen3_5_model, qwen3_5_reference,
                                                                                 workload):
    params = PARAMS
    prompts, without = workload
    expected = [_transformers_greedy(qwen3_5_reference, ids) for ids in prompts]
    assert without == expected
    # a KV budget short of the three: requests preempted (their state recomputed) between drafts
    spec = cpu_llm(qwen3_5_model, speculative_config=SPEC, max_num_seqs=4, num_kv_blocks=7,
                   max_num_batched_tokens=16)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == expected
    stats = spec.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"], \
        "the prompts were meant to give drafts accepted and drafts rejected"
    assert stats["num_preemptions"] > 0, "the KV budget was meant to force preemption"
    assert spec.engine.runner.state_cache.usage == 0 and spec.engine.num_free_blocks() == spec.engine.num_blocks


@pytest.mark.parametrize("qwen3_5_model", ["qwen3.5-tiny"], indirect=True)
def test_a_drafts_checkpoints_are_the_states_of_decoding_one_token_at_a_time(qwen3_5_model, monkeypatch):
    """Two sequences in one step: one verifying a 3-token draft, one decoding a token; the draft's
    state after each position equals the state decoding its tokens one at a time leaves (both on
    the torch ops: a step with a draft takes them, and the CPU kernel is checked against them in
    tests/unit/engine/test_gated_delta_cpu.py)."""
    from epd.engine.layers import gated_deltanet

    monkeypatch.setattr(gated_deltanet, "use_cpu_kernel", False)
    from epd.engine.config import EngineConfig
    from epd.engine.engine_core import EngineCore
    from epd.engine.layers.forward_batch import ForwardBatch
    from epd.engine.state_cache import StateCache

    runner = EngineCore(qwen3_5_model, EngineConfig(dtype="float32", num_kv_blocks=8)).runner
    layer = next(m for m in runner.model.modules() if type(m).__name__ == "GatedDeltaNet")
    assert layer.state_idx == 0  # the first state-carrying layer: a one-layer cache is its whole state
    shapes = [layer.state_shapes()]
    gen = torch.Generator().manual_seed(0)
    hidden = runner.model.cfg.hidden_size
    x = torch.randn(5, hidden, generator=gen)  # rows 0..3: the draft's 4 positions, row 4: the decode

    def run(q_lens, rows, slots, checkpoint_seqs, cache):
        meta = type("Meta", (), {})()
        meta.cu_seqlens_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
        meta.seq_lens = torch.tensor([10 + n for n in q_lens])  # each continues a context: read the slot
        batch = ForwardBatch(positions=None, attn_meta=meta, backend=None, kv_caches=[],
                             state_caches=cache.layers, state_slots=slots, checkpoint_seqs=checkpoint_seqs)
        with torch.no_grad():
            out = layer(x[rows], batch)
        return out, batch

    def seeded_cache():
        cache = StateCache(shapes, 2, torch.float32, torch.device("cpu"))
        for conv, rec in cache.layers:
            conv.copy_(torch.randn(conv.shape, generator=torch.Generator().manual_seed(1)))
            rec.copy_(torch.randn(rec.shape, generator=torch.Generator().manual_seed(2)))
        return cache

    together = seeded_cache()
    out, batch = run([4, 1], [0, 1, 2, 3, 4], [0, 1], [0], together)
    conv_ck, rec_ck = batch.state_checkpoints[0]
    assert conv_ck.shape[:2] == rec_ck.shape[:2] == (1, 3)  # after positions 0..2; after 3: the slot
    one_by_one = seeded_cache()
    for j in range(4):
        step, _ = run([1], [j], [0], [], one_by_one)
        conv, rec = one_by_one.layers[0]
        torch.testing.assert_close(step, out[j:j + 1], rtol=0, atol=1e-6)
        want_conv, want_rec = (conv_ck[0, j], rec_ck[0, j]) if j < 3 else (c[0] for c in together.layers[0])
        torch.testing.assert_close(want_conv, conv[0], rtol=0, atol=0)
        torch.testing.assert_close(want_rec, rec[0], rtol=0, atol=1e-6)
    decoded, _ = run([1], [4], [1], [], seeded_cache())
    torch.testing.assert_close(out[4:], decoded, rtol=0, atol=1e-6)  # the decode beside it: unchanged
    together.roll_back(0, batch.state_checkpoints, 0, 1)  # two of the four positions accepted
    accepted = seeded_cache()
    for j in range(2):
        run([1], [j], [0], [], accepted)
    for (conv, rec), (conv_want, rec_want) in zip(together.layers, accepted.layers):
        torch.testing.assert_close(conv[0], conv_want[0], rtol=0, atol=0)
        torch.testing.assert_close(rec[0], rec_want[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("qwen3_5_model", ["qwen3.5-tiny"], indirect=True)
@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_a_decode_engine_speculates_from_a_handed_over_state(qwen3_5_model, method, workload):
    """e-p-d without the processes: the prefill engine's state (and, MTP, its head's blocks, as for
    EAGLE-3) crosses in a KVTransfer, the decode engine verifies drafts from it, rolling back on
    rejection: the aggregated tokens."""
    from epd.engine.config import EngineConfig
    from epd.engine.engine_core import EngineCore
    from epd.engine.request import Request
    from epd.transport.wire.messages import KVTransfer, decode_message

    params = PARAMS
    prompts = {f"r{i}": ids for i, ids in enumerate(workload[0])}
    expected = dict(zip(prompts, workload[1]))

    def core(role, **spec):
        return EngineCore(qwen3_5_model, EngineConfig.from_flat(num_kv_blocks=32, max_num_batched_tokens=16,
                                                                 dtype="float32", device="cpu", **spec), role=role)

    spec = SPEC if method == "ngram" else {"method": "mtp", "num_speculative_tokens": 3}
    prefill, decode = core("prefill", speculative_config=spec), core("decode", speculative_config=spec)
    for rid, prompt in prompts.items():
        prefill.add_request(Request(rid, list(prompt), params))
    got = {}
    while prefill.has_unfinished():
        for update in prefill.step().updates:
            rid, token = update.request_id, update.new_token_ids[0]
            sent = KVTransfer(rid, prompts[rid], token, params, [], [], *prefill.export_kv(rid),
                              draft_state=prefill.export_draft_state(rid), state=prefill.export_state(rid))
            assert (sent.draft_state is not None) == (method == "mtp")
            msg = decode_message([bytes(f) for f in sent.to_wire()])
            request = Request(rid, list(prompts[rid]), params)
            request.output_token_ids.append(token)
            assert decode.add_prefilled(request, msg.k_blocks, msg.v_blocks, msg.draft_state, msg.state)
            assert prefill.release(rid)
            got[rid] = [token]
    while decode.has_unfinished():
        for update in decode.step().updates:
            got[update.request_id] += update.new_token_ids
    assert got == expected
    stats = decode.stats()
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]  # rejections
    assert stats["spec_decode_num_accepted_tokens"] > 0 or method == "mtp"  # random MTP layers: maybe none
    assert decode.runner.state_cache.usage == 0 and decode.num_free_blocks() == decode.num_blocks
