"""The Gated DeltaNet math (engine/layers/gated_delta.py, causal_conv1d.py): one prefill chunk,
several chunks carried through the state, token-by-token decode and transformers' torch paths
all agree in float32."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from epd.engine.layers.causal_conv1d import causal_conv1d_decode, causal_conv1d_prefill
from epd.engine.layers.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule

NUM_K_HEADS, NUM_V_HEADS, K_DIM, V_DIM = 2, 4, 16, 8
TOL = dict(atol=1e-5, rtol=1e-5)


def make_inputs(num_tokens: int, seed: int = 0, num_seqs: int | None = None):
    """q, k, v, g, beta of one sequence ([num_tokens, heads, ...]) or of `num_seqs` ([num_seqs, ...])."""
    gen = torch.Generator().manual_seed(seed)
    lead = (num_tokens,) if num_seqs is None else (num_seqs, num_tokens)
    q = torch.randn(*lead, NUM_K_HEADS, K_DIM, generator=gen)
    k = torch.randn(*lead, NUM_K_HEADS, K_DIM, generator=gen)
    v = torch.randn(*lead, NUM_V_HEADS, V_DIM, generator=gen)
    # the model's log decay -A * softplus(a + dt_bias), A per head in (0.01, 1.5): the state lasts
    g = -torch.empty(NUM_V_HEADS).uniform_(0.01, 1.5, generator=gen) * F.softplus(
        torch.randn(*lead, NUM_V_HEADS, generator=gen) - 2)
    beta = torch.randn(*lead, NUM_V_HEADS, generator=gen).sigmoid()
    return q, k, v, g, beta


def transformers_chunk(q, k, v, g, beta, state=None):
    out, final = hf.torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                 initial_state=None if state is None else state[None],
                                                 output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[0], final[0]


def test_one_chunk_is_transformers_chunked_rule():
    q, k, v, g, beta = make_inputs(150)  # three 64-token chunks, the last one padded
    initial = torch.randn(NUM_V_HEADS, K_DIM, V_DIM, generator=torch.Generator().manual_seed(1))
    for state in (None, initial):
        out, final = chunk_gated_delta_rule(q, k, v, g, beta, state)
        ref_out, ref_final = transformers_chunk(q, k, v, g, beta, state)
        torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(final, ref_final, atol=1e-6, rtol=1e-6)


def test_chunks_carried_through_the_state_and_decode_agree():
    q, k, v, g, beta = make_inputs(150)
    whole, whole_state = chunk_gated_delta_rule(q, k, v, g, beta, None)

    state, outs = None, []
    for lo, hi in ((0, 37), (37, 101), (101, 102), (102, 150)):  # engine chunks that cut 64-token chunks
        out, state = chunk_gated_delta_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs), whole, **TOL)
    torch.testing.assert_close(state, whole_state, **TOL)

    states = torch.zeros(1, NUM_V_HEADS, K_DIM, V_DIM)
    steps = [recurrent_gated_delta_rule(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], states)
             for t in range(150)]
    torch.testing.assert_close(torch.cat(steps), whole, **TOL)
    torch.testing.assert_close(states[0], whole_state, **TOL)


def test_decode_is_transformers_recurrent_rule_per_sequence():
    num_seqs = 3
    q, k, v, g, beta = make_inputs(1, seed=2, num_seqs=num_seqs)  # [seqs, 1, heads, dim]
    states = torch.randn(num_seqs, NUM_V_HEADS, K_DIM, V_DIM, generator=torch.Generator().manual_seed(3))
    ref_out, ref_state = hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=states.clone(),
                                                             output_final_state=True,
                                                             use_qk_l2norm_in_kernel=True)
    out = recurrent_gated_delta_rule(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], states)
    torch.testing.assert_close(out, ref_out[:, 0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(states, ref_state, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("cuts", [(), (2,), (1, 2, 9), (5, 6, 7)])
def test_causal_conv1d_chunks_and_decode_are_transformers(cuts):
    num_tokens, channels, kernel = 12, 6, 4
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(num_tokens, channels, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    ref = hf.causal_conv1d_fn(x.t()[None], weight, None, activation="silu")[0].t()  # [num_tokens, channels]

    state, outs = None, []
    bounds = (0, *cuts, num_tokens)
    for lo, hi in zip(bounds, bounds[1:]):  # a chunk shorter than the state keeps older inputs
        out, state = causal_conv1d_prefill(x[lo:hi], weight, state)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs), ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(state, x[-(kernel - 1):].t())

    head = cuts[0] if cuts else num_tokens
    _, state = causal_conv1d_prefill(x[:head], weight, None)
    states = state[None].clone()
    ref_states = state[None].clone()
    for t in range(head, num_tokens):
        out = causal_conv1d_decode(x[t:t + 1], weight, states)
        ref_out = hf.causal_conv1d_update(x[t:t + 1, :, None], ref_states, weight, None, activation="silu")
        torch.testing.assert_close(out, ref_out[:, :, 0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(out[0], ref[t], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(states, ref_states)
