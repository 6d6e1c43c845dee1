"""Eagle3Proposer (engine/spec/eagle3_proposer.py) against engine/spec/eagle3.py's one-sequence
`propose` on a dense cache (itself held to the published architecture in test_eagle3.py):
the head's entries written into scattered paged blocks chunk by chunk, a verification
step's accepted positions only, a prefix-cache hit that looks behind once, and the
e-p-d hand-over (export on one proposer, import into another's other blocks) all draft
the tokens the dense reference drafts from the same sequence."""
from __future__ import annotations

import pytest
import torch

from epd.engine.request import Request
from epd.engine.spec.eagle3 import DenseKV, Eagle3Config, Eagle3Head, propose
from epd.engine.spec.eagle3_proposer import CatchUp, Eagle3Proposer

CFG = Eagle3Config(hidden_size=32, target_hidden_size=48, intermediate_size=64, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=100,
                   draft_vocab_size=100, aux_layer_ids=(0, 1, 2), num_speculative_tokens=3)
BLOCK_SIZE, K = 4, 3


@pytest.fixture(scope="module")
def parts():
    torch.manual_seed(0)
    head = Eagle3Head(CFG).eval()
    with torch.no_grad():
        head.t2d.fill_(True)
        head.lm_head.weight.mul_(20)  # peaked: argmax not decided by rounding
    embed = torch.nn.Embedding(CFG.vocab_size, CFG.hidden_size)
    tokens = torch.randint(0, CFG.vocab_size, (30,)).tolist()
    aux = [torch.randn(30, CFG.target_hidden_size) for _ in range(3)]  # the target's states at each position
    return head, embed, tokens, aux


def _proposer(head, embed) -> Eagle3Proposer:
    return Eagle3Proposer(CFG, head, embed, num_blocks=24, block_size=BLOCK_SIZE, num_speculative_tokens=K,
                          device=torch.device("cpu"), dtype=torch.float32)


def _reference(head, embed, tokens, aux, c: int) -> list[int]:
    """Drafts after the target computed positions 0..c-1 and token c is known: entries of
    tokens 1..c (features of positions 0..c-1) on a dense cache, then K greedy steps."""
    with torch.no_grad():
        return propose(head, DenseKV(CFG.num_layers), [a[:c] for a in aux], torch.tensor(tokens[1:c + 1]),
                       torch.arange(1, c + 1), embed, K).tolist()


def _feed(p: Eagle3Proposer, rid: str, blocks: list[int], tokens, aux, start: int, end: int,
          lookbehind: bool = False) -> None:
    """A target forward over positions [start, end) (and start - 1 first when looking behind)."""
    first = start - 1 if lookbehind else start
    p.catch_up([CatchUp(rid, blocks, start, first, 0, end, tokens)], [a[first:end] for a in aux])


def _request(rid: str, tokens, c: int, blocks: list[int]) -> Request:
    r = Request(rid, list(tokens[:c + 1]))
    r.num_computed_tokens, r.block_ids = c, blocks
    return r


def test_chunks_into_scattered_blocks_draft_as_the_dense_reference(parts):
    head, embed, tokens, aux = parts
    p = _proposer(head, embed)
    blocks = [17, 3, 9, 0, 21, 5, 12, 8]
    for start, end in [(0, 5), (5, 6), (6, 13), (13, 14)]:  # prompt chunks, then a decode
        assert not p.needs_lookbehind("a", start)
        _feed(p, "a", blocks, tokens, aux, start, end)
    [draft] = p.propose_requests([_request("a", tokens, 14, blocks)])
    assert draft == _reference(head, embed, tokens, aux, 14)
    # a verification of 3 draft tokens of which 2 were accepted: positions 14..16 count, 17 not
    _feed(p, "a", blocks, tokens, aux, 14, 17)
    [draft] = p.propose_requests([_request("a", tokens, 17, blocks)])
    assert draft == _reference(head, embed, tokens, aux, 17)


def test_a_prefix_hit_looks_behind_once_and_drafts_as_the_reference(parts):
    head, embed, tokens, aux = parts
    p = _proposer(head, embed)
    shared = [4, 11, 2]  # three full blocks: 12 tokens
    _feed(p, "first", shared + [7], tokens, aux, 0, 14)
    mine = shared + [19, 6]  # a later request hits the 12 cached tokens
    assert p.needs_lookbehind("second", 12)
    assert p.propose_requests([_request("second", tokens, 12, mine)]) == [[]]  # no features: no draft yet
    _feed(p, "second", mine, tokens, aux, 12, 18, lookbehind=True)
    [draft] = p.propose_requests([_request("second", tokens, 18, mine)])
    assert draft == _reference(head, embed, tokens, aux, 18)


def test_the_hand_over_drafts_as_the_prefill_side_would(parts):
    head, embed, tokens, aux = parts
    prefill, decode = _proposer(head, embed), _proposer(head, embed)
    _feed(prefill, "r", [1, 2, 3], tokens, aux, 0, 10)  # the prompt: 10 tokens, then token 10 sampled
    k, v, features = prefill.export("r", [1, 2, 3], 10)
    request = Request("r", list(tokens[:10]))  # as the KVTransfer brings it: the prompt, then token 10
    request.output_token_ids.append(tokens[10])
    request.num_computed_tokens, request.block_ids = 10, [20, 14, 8]
    decode.check_import(k, v, features, 3)
    decode.import_state(request, [20, 14, 8], k, v, features)
    want = _reference(head, embed, tokens, aux, 10)
    assert prefill.propose_requests([_request("r", tokens, 10, [1, 2, 3])]) == [want]
    assert decode.propose_requests([request]) == [want]
    with pytest.raises(ValueError, match="do not fit"):
        decode.check_import(k[:, :2], v[:, :2], features, 3)
