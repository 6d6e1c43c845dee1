"""The gated delta rule of a Gated DeltaNet layer: chunked for prefill, recurrent for decode.

Per value head the recurrent state S [k_dim, v_dim] follows, token by token,
    S <- exp(g) * S;  S <- S + k (beta * (v - S^T k))^T;  out = S^T q
with q and k L2-normalised and q scaled by k_dim ** -0.5. The chunked form computes the same
over chunks of 64 tokens with a triangular solve per chunk (the UT transform) and one state
update per chunk; a prefill chunk starts from the state the previous chunk left, so a prompt
prefilled in several engine chunks carries its state through the state cache.

torch only, in float32 whatever the inputs' dtype, as transformers' torch paths
(`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`), which the tests compare
against. GPU kernels (fla-core's Triton `chunk_gated_delta_rule` /
`fused_recurrent_gated_delta_rule`) would sit behind these same two calls.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (fla's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _heads_first(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
    """[..., tokens, heads, dim] -> float32 [..., heads, tokens, dim], q and k repeated to the value
    heads (each key head serves num_v_heads // num_k_heads consecutive value heads), normalised."""
    num_k_heads, num_v_heads = k.shape[-2], v.shape[-2]
    assert num_v_heads % num_k_heads == 0, (num_k_heads, num_v_heads)
    if num_k_heads != num_v_heads:
        q = q.repeat_interleave(num_v_heads // num_k_heads, dim=-2)
        k = k.repeat_interleave(num_v_heads // num_k_heads, dim=-2)
    q, k, v = (x.transpose(-3, -2).to(torch.float32, memory_format=torch.contiguous_format) for x in (q, k, v))
    g, beta = (x.transpose(-2, -1).to(torch.float32, memory_format=torch.contiguous_format) for x in (g, beta))
    q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, initial_state: torch.Tensor | None,
                           chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's prefill chunk: q, k [num_tokens, num_k_heads, k_dim], v [num_tokens,
    num_v_heads, v_dim], g (log decay, <= 0) and beta [num_tokens, num_v_heads], initial_state
    [num_v_heads, k_dim, v_dim] float32 (None: zeros) -> out [num_tokens, num_v_heads, v_dim]
    in v's dtype and the final state [num_v_heads, k_dim, v_dim] float32."""
    num_tokens, num_v_heads, v_dim = v.shape
    k_dim, dtype = k.shape[-1], v.dtype
    assert q.shape == k.shape and g.shape == beta.shape == (num_tokens, num_v_heads), (q.shape, g.shape)
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)  # [heads, tokens, dim], g and beta [heads, tokens]

    pad = (chunk_size - num_tokens % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    num_chunks = (num_tokens + pad) // chunk_size

    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    # [heads, chunks, chunk_size, dim]
    q, k, k_beta, v_beta = (x.reshape(num_v_heads, num_chunks, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(num_v_heads, num_chunks, chunk_size)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)

    cum_g = g.cumsum(dim=-1)  # log of the decay from the chunk's start to each position
    # decay between positions j <= i of a chunk; above the diagonal masked before the exp
    pair_decay = (cum_g.unsqueeze(-1) - cum_g.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    ut_system = (k_beta @ k.transpose(-1, -2)) * pair_decay
    intra = (q @ k.transpose(-1, -2)) * pair_decay
    # the UT transform: the chunk's delta-rule updates in a unit lower-triangular solve
    new_v = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, k_beta * cum_g.exp().unsqueeze(-1),
                                               upper=False, unitriangular=True)

    if initial_state is None:
        state = torch.zeros(num_v_heads, k_dim, v_dim, dtype=torch.float32, device=q.device)
    else:
        assert initial_state.shape == (num_v_heads, k_dim, v_dim), (initial_state.shape, num_v_heads, k_dim, v_dim)
        state = initial_state.to(new_v)
    out = torch.zeros_like(new_v)
    q = q * cum_g.exp().unsqueeze(-1)
    k = k * (cum_g[..., -1:] - cum_g).exp().unsqueeze(-1)
    chunk_decay = cum_g[..., -1].exp()[..., None, None]  # [heads, chunks, 1, 1]
    for i in range(num_chunks):
        v_i = new_v[:, i] - k_cumdecay[:, i] @ state  # the part the state does not already predict
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_i
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_i

    out = out.reshape(num_v_heads, -1, v_dim)[:, :num_tokens]
    return out.transpose(0, 1).contiguous().to(dtype), state


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """One decode token per sequence: q, k [num_seqs, num_k_heads, k_dim], v [num_seqs, num_v_heads,
    v_dim], g and beta [num_seqs, num_v_heads], states [num_seqs, num_v_heads, k_dim, v_dim] float32,
    updated in place -> out [num_seqs, num_v_heads, v_dim] in v's dtype."""
    num_seqs, num_v_heads, v_dim = v.shape
    assert states.shape == (num_seqs, num_v_heads, k.shape[-1], v_dim), (states.shape, k.shape, v.shape)
    dtype = v.dtype
    # [seqs, heads, 1, dim]: one token, the heads-first layout of the chunked rule
    q, k, v, g, beta = _heads_first(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), g.unsqueeze(1), beta.unsqueeze(1))
    q, k, v, g, beta = q[:, :, 0], k[:, :, 0], v[:, :, 0], g[:, :, 0], beta[:, :, 0]
    state = states.to(torch.float32) * g.exp()[..., None, None]
    predicted = (state * k.unsqueeze(-1)).sum(dim=-2)  # [seqs, heads, v_dim]: S^T k
    delta = (v - predicted) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    states.copy_(state)
    return (state * q.unsqueeze(-1)).sum(dim=-2).to(dtype)
