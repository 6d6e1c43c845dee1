"""The paged attention layer: q, k and v from one fused projection, optional
per-head RMSNorm on q and k (Qwen3; Gemma's 1 + w flavour by `norm_unit_offset`)
or q/k/v biases (Qwen2.5, GLM), rotary (on the whole head or its first
`rotary_dim` dims, halves or adjacent pairs: layers/rotary.py), GQA; the
softmax scale head_dim^-0.5 unless
given (Gemma 3: query_pre_attn_scalar^-0.5); per layer an optional sliding
window and attention logit soft-cap.
The KV cache is read and written through the backend in the `ForwardBatch`
(engine/attention/)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from epd.engine.layers.forward_batch import ForwardBatch
from epd.engine.layers.norm import RMSNorm
from epd.engine.layers.rotary import apply_rotary, apply_rotary_pairs
from epd.transport.weights.cpu_linear import linear_add


class Attention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int,
                 rms_norm_eps: float, bias: bool = False, qk_norm: bool = True,
                 sliding_window: int | None = None, softcap: float | None = None, norm_unit_offset: bool = False,
                 scale: float | None = None, rotary_dim: int | None = None, rotary_pairs: bool = False):
        """`sliding_window`: this layer's window W (transformers' `sliding_window`: a query at
        position i sees keys j > i - W), None: global; `softcap`: its attention logit soft-cap
        (scores s -> softcap * tanh(s / softcap)), None: none; `norm_unit_offset`: Gemma's q/k
        norms (x * (1 + w)); `scale`: the softmax scale (None: head_dim^-0.5); `rotary_dim`: the
        leading dims of each head that rotate (None: all); `rotary_pairs`: they rotate as adjacent
        pairs (GLM-4.1V) rather than halves."""
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        # q, k and v projections fused into one matmul (the loader stacks them).
        self.qkv_proj = nn.Linear(hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, hidden_size, bias=False)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, rms_norm_eps, norm_unit_offset)
            self.k_norm = RMSNorm(head_dim, rms_norm_eps, norm_unit_offset)
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.sliding_window, self.softcap = sliding_window, softcap
        self.rotary_dim = rotary_dim or head_dim
        self.rotate = apply_rotary_pairs if rotary_pairs else apply_rotary

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                residual: torch.Tensor | None) -> torch.Tensor:
        """x [N, hidden] normed -> residual + attention output [N, hidden] (residual None: the
        output alone, for a model that norms it before the sum)."""
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        # q and k heads side by side ([N, Hq + Hkv, D], a view): normed and rotated together
        qk = qkv[:, :self.q_size + self.kv_size].view(n, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(n, self.num_kv_heads, self.head_dim)  # [N, Hkv, D]
        if self.qk_norm:
            qk = self._norm_qk(qk)
        qk = self._rotate(qk, cos.to(qk.dtype), sin.to(qk.dtype))
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]  # [N, Hq, D], [N, Hkv, D]
        k_cache, v_cache = batch.kv_caches[self.layer_idx]
        batch.backend.store_kv(k, v, k_cache, v_cache, batch.attn_meta.slot_mapping)
        o = batch.backend.attention(q, k_cache, v_cache, batch.attn_meta, self.scale,
                                    window=self.sliding_window, softcap=self.softcap)  # [N, Hq, D]
        if residual is None:
            return self.o_proj(o.reshape(n, self.q_size))
        return linear_add(self.o_proj, o.reshape(n, self.q_size), residual)

    def _rotate(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[N, Hq + Hkv, D] rotated on its first `rotary_dim` dims, the rest passed through."""
        if self.rotary_dim == self.head_dim:
            return self.rotate(qk, cos, sin)
        return torch.cat((self.rotate(qk[..., :self.rotary_dim], cos, sin), qk[..., self.rotary_dim:]), dim=-1)

    def _norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        """Per-head RMSNorm of [N, Hq + Hkv, D], q_norm's weight on the q heads and k_norm's on the k heads."""
        if qk.dtype != torch.float32 or self.q_norm.unit_offset:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            return torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        weight = torch.cat((self.q_norm.weight.expand(self.num_heads, -1),
                            self.k_norm.weight.expand(self.num_kv_heads, -1)))  # [Hq + Hkv, D]
        return F.rms_norm(qk, (self.head_dim,), None, self.q_norm.eps).mul_(weight)
