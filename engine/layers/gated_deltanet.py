"""The Gated DeltaNet layer (Qwen3.5's linear attention), over a per-request state cache.

Per token: q, k, v from one projection through a short causal conv (causal_conv1d.py), a decay
g = -exp(A_log) * softplus(a + dt_bias) and a write strength beta = sigmoid(b) per value head, the
gated delta rule (gated_delta.py) on the sequence's recurrent state, then a per-head RMSNorm of
the output gated by silu(z) and the output projection. A sequence's state lives in the slot
`batch.state_slots[b]` of this layer's `batch.state_caches[state_idx]`: prefill chunks run the
chunked rule from it (from zeros when the chunk starts the sequence) and write the final state
back; decode tokens run the recurrent rule on their slots in one batch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from epd.engine.layers.causal_conv1d import causal_conv1d_decode, causal_conv1d_prefill
from epd.engine.layers.forward_batch import ForwardBatch
from epd.engine.layers.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dim, then times silu(gate) (transformers' `RMSNormGated`, norm before gate)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, k_dim: int, v_dim: int,
                 conv_kernel: int, rms_norm_eps: float, state_idx: int):
        """`state_idx`: this layer's place among the model's state-carrying layers (its entry of
        `ForwardBatch.state_caches`)."""
        super().__init__()
        self.num_k_heads, self.num_v_heads, self.k_dim, self.v_dim = num_k_heads, num_v_heads, k_dim, v_dim
        self.key_size, self.value_size = num_k_heads * k_dim, num_v_heads * v_dim
        self.conv_dim = 2 * self.key_size + self.value_size
        self.conv_kernel = conv_kernel
        self.state_idx = state_idx
        self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, self.value_size, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, conv_kernel))  # the checkpoint's Conv1d
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = GatedRMSNorm(v_dim, rms_norm_eps)
        self.out_proj = nn.Linear(self.value_size, hidden_size, bias=False)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One request's (conv state, recurrent state) shapes: [conv_dim, kernel - 1] and
        [num_v_heads, k_dim, v_dim] (float32)."""
        return (self.conv_dim, self.conv_kernel - 1), (self.num_v_heads, self.k_dim, self.v_dim)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x [N, hidden] normed -> the layer's output [N, hidden]."""
        n = x.shape[0]
        mixed = self.in_proj_qkv(x)  # [N, conv_dim]
        z = self.in_proj_z(x).view(n, self.num_v_heads, self.v_dim)
        beta = self.in_proj_b(x).sigmoid()  # [N, Hv]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)  # [N, Hv] float32
        conv_states, rec_states = batch.state_caches[self.state_idx]
        weight = self.conv1d.weight[:, 0]  # [conv_dim, kernel]
        meta = batch.attn_meta
        cu, seq_lens = meta.cu_seqlens_q.tolist(), meta.seq_lens.tolist()
        out = x.new_empty(n, self.num_v_heads, self.v_dim)

        decodes = [b for b in range(len(seq_lens)) if cu[b + 1] - cu[b] == 1 and seq_lens[b] > 1]
        if decodes:  # one token each, from their slots, in one batch
            rows = torch.tensor([cu[b] for b in decodes], device=x.device)
            slots = torch.tensor([batch.state_slots[b] for b in decodes], device=x.device)
            conv = conv_states[slots]
            q, k, v = self._split(causal_conv1d_decode(mixed[rows], weight, conv))
            conv_states[slots] = conv
            rec = rec_states[slots]
            out[rows] = recurrent_gated_delta_rule(q, k, v, g[rows], beta[rows], rec)
            rec_states[slots] = rec
        for b in sorted(set(range(len(seq_lens))) - set(decodes)):  # prefill chunks, one sequence at a time
            lo, hi = cu[b], cu[b + 1]
            slot, is_fresh = batch.state_slots[b], hi - lo == seq_lens[b]
            q_k_v, conv = causal_conv1d_prefill(mixed[lo:hi], weight, None if is_fresh else conv_states[slot])
            conv_states[slot] = conv
            q, k, v = self._split(q_k_v)
            out[lo:hi], rec_states[slot] = chunk_gated_delta_rule(q, k, v, g[lo:hi], beta[lo:hi],
                                                                  None if is_fresh else rec_states[slot])
        out = self.norm(out, z).reshape(n, self.value_size)
        return self.out_proj(out)

    def _split(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[M, conv_dim] -> q, k [M, Hk, k_dim], v [M, Hv, v_dim]."""
        q, k, v = mixed.split([self.key_size, self.key_size, self.value_size], dim=-1)
        return (q.reshape(-1, self.num_k_heads, self.k_dim), k.reshape(-1, self.num_k_heads, self.k_dim),
                v.reshape(-1, self.num_v_heads, self.v_dim))
