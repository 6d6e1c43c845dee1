"""Qwen3.5 handed from a prefill engine to a decode engine (e-p-d's hand-over, without the
processes): the KV and the Gated DeltaNet layers' named state cross the wire in one KVTransfer,
and the decode engine gives transformers' greedy tokens and top-5 logprobs (float32) for prompts
prefilled over several chunks; the state's bytes count in the transfer's; a missing, unknown or
misshapen state is refused by name, changing nothing."""
from __future__ import annotations

import pytest
import torch

from epd.engine.config import EngineConfig
from epd.engine.engine_core import EngineCore
from epd.engine.request import Request
from epd.transport.wire.messages import KVTransfer, decode_message
from epd.transport.wire.sampling import SamplingParams

NUM_TOKENS = 5
PROMPT_LENS = (19, 47)  # over 2 and 3 chunks of 16 tokens
TOP5 = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
pytestmark = pytest.mark.parametrize("qwen3_5_model", ["qwen3.5-tiny"], indirect=True)


def _core(model: str, role: str, num_kv_blocks: int = 16) -> EngineCore:
    config = EngineConfig.from_flat(num_kv_blocks=num_kv_blocks, max_num_batched_tokens=16, max_num_seqs=4,
                                    dtype="float32", device="cpu")
    return EngineCore(model, config, role=role)


def _prefilled(request_id: str, prompt: list[int], first_token_id: int) -> Request:
    request = Request(request_id, list(prompt), TOP5)
    request.output_token_ids.append(first_token_id)
    return request


@torch.no_grad()
def _reference(model, ids: list[int]) -> tuple[list[int], list[list[int]], torch.Tensor]:
    """transformers' greedy (tokens, top-5 ids per token, their logprobs [NUM_TOKENS, 5])."""
    out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    top = torch.log_softmax(torch.cat(out.logits).float(), dim=-1).topk(5)
    return out.sequences[0, len(ids):].tolist(), top.indices.tolist(), top.values


def test_state_handed_over_with_the_kv_decodes_like_transformers(qwen3_5_model, qwen3_5_reference):
    gen = torch.Generator().manual_seed(7)
    prompts = {f"r{n}": torch.randint(16, 1000, (n,), generator=gen).tolist() for n in PROMPT_LENS}
    prefill, decode = _core(qwen3_5_model, "prefill"), _core(qwen3_5_model, "decode")
    for rid, prompt in prompts.items():
        prefill.add_request(Request(rid, list(prompt), TOP5))
    got = {rid: [] for rid in prompts}  # request id -> its TokenLogprobs, the first token's from prefill
    while prefill.has_unfinished():
        result = prefill.step()
        for update in result.updates:
            assert update.is_prefilled
            got[update.request_id] += result.logprobs[update.request_id]
            k, v = prefill.export_kv(update.request_id)
            state = prefill.export_state(update.request_id)
            sent = KVTransfer(update.request_id, prompts[update.request_id], update.new_token_ids[0], TOP5, [], [],
                              k, v, state=state)
            msg = decode_message([bytes(f) for f in sent.to_wire()])  # as the decode worker's inbox takes it
            assert sorted(msg.state) == sorted(f"{kind}.{i}" for kind in ("conv", "recurrent") for i in range(3))
            assert msg.num_bytes == k.nbytes + v.nbytes + sum(t.nbytes for t in state.values())
            assert decode.add_prefilled(_prefilled(update.request_id, prompts[update.request_id],
                                                   update.new_token_ids[0]), msg.k_blocks, msg.v_blocks,
                                        msg.draft_state, msg.state)
            assert prefill.release(update.request_id)
    assert prefill.runner.state_cache.usage == 0  # each slot back once its state was exported
    while decode.has_unfinished():
        result = decode.step()
        for update in result.updates:
            got[update.request_id] += result.logprobs[update.request_id]
    assert decode.runner.state_cache.usage == 0 and decode.num_free_blocks() == decode.num_blocks

    for rid, prompt in prompts.items():
        tokens, top_ids, top_logprobs = _reference(qwen3_5_reference, prompt)
        assert [lp.token_id for lp in got[rid]] == tokens, rid
        for lp, ids, values in zip(got[rid], top_ids, top_logprobs):
            assert [t for t, _ in lp.top] == ids, rid
            torch.testing.assert_close(torch.tensor([p for _, p in lp.top]), values, rtol=0, atol=1e-4)


def test_a_missing_unknown_or_misshapen_state_is_refused_by_name(qwen3_5_model):
    decode = _core(qwen3_5_model, "decode", num_kv_blocks=4)
    names = decode.runner.state_cache.names()  # name -> (shape, dtype)
    state = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in names.items()}
    num_layers, block_size, num_kv_heads, head_dim = decode.runner.block_shape  # the full-attention layers'
    shape = (num_layers, 2, block_size, num_kv_heads, head_dim)
    k, v = torch.zeros(shape), torch.zeros(shape)
    bad = [({}, "no per-request state came with the KV"),
           ({**state, "conv.9": torch.zeros(2)}, r"unknown \['conv.9'\]"),
           ({n: t for n, t in state.items() if n != "recurrent.1"}, r"missing \['recurrent.1'\]"),
           ({**state, "recurrent.0": torch.zeros(1, 2)}, r"'recurrent.0' is torch.float32 \[1, 2\]"),
           ({**state, "conv.0": state["conv.0"].long()}, "'conv.0' is torch.int64")]
    for i, (given, named) in enumerate(bad):
        with pytest.raises(ValueError, match=named):
            decode.add_prefilled(_prefilled(f"r{i}", list(range(10, 30)), 5), k, v, None, given)
    assert decode.num_free_blocks() == 4 and not decode.has_unfinished()
    assert decode.add_prefilled(_prefilled("ok", list(range(10, 30)), 5), k, v, None, state)
