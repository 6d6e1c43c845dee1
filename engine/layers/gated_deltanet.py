"""The Gated DeltaNet layer (Qwen3.5's linear attention), over a per-request state cache.

Per token: q, k, v from one projection through a short causal conv (causal_conv1d.py), a decay
g = -exp(A_log) * softplus(a + dt_bias) and a write strength beta = sigmoid(b) per value head, the
gated delta rule (gated_delta.py) on the sequence's recurrent state, then a per-head RMSNorm of
the output gated by silu(z) and the output projection. A sequence's state lives in the slot
`batch.state_slots[b]` of this layer's `batch.state_caches[state_idx]`: prefill chunks run the
chunked rule from it (from zeros when the chunk starts the sequence) and write the final state
back; decode tokens run the recurrent rule on their slots in one batch. On CPU one call of
gated_delta_cpu.py's fused kernel runs all of a step's sequences in place in their slots (these
torch ops where it is not built, or where a step verifies a draft). A draft being verified
(speculative decoding: the sequences `batch.checkpoint_seqs`) runs token by token with the decodes,
as decoding one token at a time would, and the state after each of its positions is kept in
`batch.state_checkpoints[state_idx]`: the runner keeps the one after the last accepted token
(docs/decisions/state-rollback.md).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from epd.engine.layers import gated_delta_cpu
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
        mixed = self.in_proj_qkv(x).contiguous()  # [N, conv_dim]
        z = self.in_proj_z(x).contiguous()  # [N, Hv * v_dim]
        a, b = self.in_proj_a(x).contiguous(), self.in_proj_b(x).contiguous()  # [N, Hv]
        conv_states, rec_states = batch.state_caches[self.state_idx]
        weight = self.conv1d.weight[:, 0]  # [conv_dim, kernel]
        meta = batch.attn_meta
        # the kernel keeps no per-position states: a step verifying a draft takes the torch ops
        kernel = None if batch.checkpoint_seqs else _cpu_kernel(mixed, rec_states, self.k_dim, self.v_dim,
                                                                 self.conv_kernel)
        if kernel is not None:  # every sequence in one call, in place in the slots
            out = x.new_empty(n, self.value_size)  # the gated, normed rule's output
            gated_delta_cpu.gated_delta(kernel, mixed, a, b, z, conv_states, weight, rec_states,
                                        self.A_log, self.dt_bias, self.norm.weight, self.norm.eps,
                                        *_kernel_plan(meta, batch.state_slots), self.num_k_heads, out)
            return self.out_proj(out)

        beta, g = self._gates(a, b)
        cu, seq_lens = meta.cu_seqlens_q.tolist(), meta.seq_lens.tolist()
        out = x.new_empty(n, self.num_v_heads, self.v_dim)

        drafts = list(batch.checkpoint_seqs)  # first: their checkpoints' rows are theirs, in this order
        steps = drafts + [b for b in range(len(seq_lens)) if cu[b + 1] - cu[b] == 1 and seq_lens[b] > 1]
        if steps:
            self._token_by_token(steps, len(drafts), mixed, g, beta, out, batch)
        for b in sorted(set(range(len(seq_lens))) - set(steps)):  # prefill chunks, one sequence at a time
            lo, hi = cu[b], cu[b + 1]
            slot, is_fresh = batch.state_slots[b], hi - lo == seq_lens[b]
            q_k_v, conv = causal_conv1d_prefill(mixed[lo:hi], weight, None if is_fresh else conv_states[slot])
            conv_states[slot] = conv
            q, k, v = self._split(q_k_v)
            out[lo:hi], rec_states[slot] = chunk_gated_delta_rule(q, k, v, g[lo:hi], beta[lo:hi],
                                                                  None if is_fresh else rec_states[slot])
        out = self.norm(out, z.view(n, self.num_v_heads, self.v_dim)).reshape(n, self.value_size)
        return self.out_proj(out)

    def _gates(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """a, b [M, Hv] -> beta = sigmoid(b) and g = -exp(A_log) * softplus(a + dt_bias) (float32)."""
        return b.sigmoid(), -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)

    def _token_by_token(self, seqs: list[int], num_drafts: int, mixed: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, out: torch.Tensor, batch: ForwardBatch) -> None:
        """Sequences `seqs` of the batch (the first `num_drafts` verifying a draft, the others one
        decode token each) position by position from their slots, in one batch per position: the
        recurrent rule and the conv's one-token update, as decoding does. Each draft's state after
        each of its positions but the last (that one is its slot's) goes to
        `batch.state_checkpoints[state_idx]`: (conv [num_drafts, max_positions, conv_dim, kernel - 1],
        recurrent [num_drafts, max_positions, Hv, k_dim, v_dim]), max_positions the longest draft's d."""
        conv_states, rec_states = batch.state_caches[self.state_idx]
        weight = self.conv1d.weight[:, 0]  # [conv_dim, kernel]
        cu = batch.attn_meta.cu_seqlens_q.tolist()
        lens = [cu[b + 1] - cu[b] for b in seqs]
        slots = torch.tensor([batch.state_slots[b] for b in seqs], device=mixed.device)
        conv, rec = conv_states[slots], rec_states[slots]  # [S, ...] copies, written back at the end
        if num_drafts:
            max_positions = max(lens[:num_drafts]) - 1  # after the last position: the slot itself
            checkpoints = (conv.new_empty(num_drafts, max_positions, *conv.shape[1:]),
                           rec.new_empty(num_drafts, max_positions, *rec.shape[1:]))
            batch.state_checkpoints[self.state_idx] = checkpoints
        for j in range(max(lens)):
            active = [i for i, n in enumerate(lens) if n > j]
            rows = torch.tensor([cu[seqs[i]] + j for i in active], device=mixed.device)
            every = len(active) == len(seqs)
            c, r = (conv, rec) if every else (conv[active], rec[active])
            q, k, v = self._split(causal_conv1d_decode(mixed[rows], weight, c))
            out[rows] = recurrent_gated_delta_rule(q, k, v, g[rows], beta[rows], r)
            if not every:
                conv[active], rec[active] = c, r
            if num_drafts and j < max_positions:  # a draft shorter than j + 1 copies its last state: never read
                checkpoints[0][:, j], checkpoints[1][:, j] = conv[:num_drafts], rec[:num_drafts]
        conv_states[slots], rec_states[slots] = conv, rec

    def _split(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[M, conv_dim] -> q, k [M, Hk, k_dim], v [M, Hv, v_dim]."""
        q, k, v = mixed.split([self.key_size, self.key_size, self.value_size], dim=-1)
        return (q.reshape(-1, self.num_k_heads, self.k_dim), k.reshape(-1, self.num_k_heads, self.k_dim),
                v.reshape(-1, self.num_v_heads, self.v_dim))


use_cpu_kernel = True  # tests switch it off to compare the kernel with the torch path


def _cpu_kernel(mixed: torch.Tensor, rec_states: torch.Tensor, k_dim: int, v_dim: int, conv_kernel: int):
    """gated_delta_cpu.py's function where it applies (CPU, float32 or bfloat16, built), else None."""
    if not (use_cpu_kernel and gated_delta_cpu.applies(mixed, rec_states, k_dim, v_dim, conv_kernel)):
        return None
    return gated_delta_cpu.load()


def _kernel_plan(meta, state_slots: list[int]) -> tuple[torch.Tensor, ...]:
    """The kernel's per-sequence start row, token count, slot (int64) and fresh flag (int32), made by
    the step's first Gated DeltaNet layer and kept in `meta.plans` for the others."""
    plan = meta.plans.get("gated_delta_cpu")
    if plan is None:
        starts = meta.cu_seqlens_q[:-1].to(torch.int64)
        num_tokens = (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]).to(torch.int64)
        fresh = (num_tokens == meta.seq_lens).to(torch.int32)
        plan = meta.plans["gated_delta_cpu"] = (starts, num_tokens, torch.tensor(state_slots, dtype=torch.int64), fresh)
    return plan
