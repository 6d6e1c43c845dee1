"""Qwen3-VL language model on a paged KV cache (and its relatives, by config).

Qwen3 decoder layers (q/k RMSNorm per head, GQA, SwiGLU MLP) with interleaved
multimodal RoPE and deepstack injection: the vision tower's intermediate
features are added to the hidden states of image tokens after the first
`num_deepstack` layers. The same modules serve Qwen3-VL-MoE (sparse MoE
blocks in `moe_layer_ids`, models/moe.py) and Qwen2.5-VL (q/k/v biases, no
q/k norm, contiguous M-RoPE sections, no deepstack); engine/models/registry.py
maps each family's config onto `TextConfig`. Tokens arrive flattened `[num_tokens]` for a whole
engine step (prefill chunks and decodes mixed); attention reads and writes
the paged cache through the backend in the `ForwardBatch`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from epd.engine.models.moe import SparseMoeBlock
from epd.engine.models.positions import PositionRule
from epd.transport.weights.checkpoint import unfilled_embedding
from epd.transport.weights.cpu_linear import linear_add, pack_linears, pack_swiglu, swiglu


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]
    mrope_interleaved: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    attention_bias: bool = False  # q/k/v projections with biases (Qwen2.5-VL)
    qk_norm: bool = True  # per-head RMSNorm on q and k (Qwen3)
    # Sparse MoE (Qwen3-VL-MoE): the layers whose MLP is a routed mixture of experts.
    moe_layer_ids: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k router probabilities to sum to 1

    @classmethod
    def from_hf(cls, hf_config) -> "TextConfig":
        tc = hf_config.text_config
        rope = dict(getattr(tc, "rope_parameters", None) or {})
        rope.update(getattr(tc, "rope_scaling", None) or {})
        if rope.get("rope_type", "default") not in ("default", "mrope"):
            raise ValueError(f"unsupported rope_type {rope.get('rope_type')!r}")
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        tie = getattr(hf_config, "tie_word_embeddings", None)
        if tie is None:
            tie = getattr(tc, "tie_word_embeddings", False)
        return cls(
            vocab_size=tc.vocab_size, hidden_size=tc.hidden_size,
            intermediate_size=tc.intermediate_size, num_layers=tc.num_hidden_layers,
            num_heads=tc.num_attention_heads, num_kv_heads=tc.num_key_value_heads or tc.num_attention_heads,
            head_dim=head_dim, rms_norm_eps=tc.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", getattr(tc, "rope_theta", 5_000_000.0))),
            mrope_section=tuple(rope.get("mrope_section", (24, 20, 20))),
            mrope_interleaved=bool(rope.get("mrope_interleaved", True)),
            tie_word_embeddings=bool(tie), max_position_embeddings=tc.max_position_embeddings,
        )


@dataclass
class ForwardBatch:
    """Everything one forward pass needs besides token ids; passed explicitly.

    `backend` provides `store_kv(k, v, k_cache, v_cache, slot_mapping)` and
    `attention(q, k_cache, v_cache, meta, scale)`; `kv_caches[layer]` is that
    layer's `(k_cache, v_cache)`, each `[num_blocks, block_size, num_kv_heads, head_dim]`.
    """

    positions: torch.Tensor  # [position_dims, num_tokens]: the model's `positions` rule (models/positions.py)
    attn_meta: object
    backend: object
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    # Image embeddings for this step, if any token of the batch is an image placeholder.
    mm_mask: torch.Tensor | None = None  # [num_tokens] bool
    mm_embeds: torch.Tensor | None = None  # [num_mm_tokens, hidden]
    # the entries' named extras (MMEntry.extras), name -> [num_mm_tokens, ...]; Qwen3-VL's deepstack
    # features are "deepstack.0", "deepstack.1", ..., each [num_mm_tokens, hidden]
    mm_extras: dict[str, torch.Tensor] = field(default_factory=dict)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:  # one fused kernel, the same sums
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MRotaryEmbedding:
    """Interleaved M-RoPE: frequency j rotates by the t, h or w position
    according to `mrope_section`, laid out t,h,w,t,h,w,... (Qwen3-VL). Given
    one row of positions it is plain RoPE (every frequency by that row), which
    is M-RoPE's own result where the three rows are equal (text).

    Not an nn.Module: its float32 tables must not follow the model's dtype.
    """

    def __init__(self, cfg: TextConfig, device: str | torch.device = "cpu"):
        dim = cfg.head_dim
        # computed on the CPU, then placed: on "meta" (a model being built for loading) an op like
        # arange runs torch's reference op, whose first use imports torch._dynamo (seconds of start-up)
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))
        self.inv_freq = inv_freq.to(device)
        half = dim // 2
        axis = torch.zeros(half, dtype=torch.long, device="cpu")  # which position row drives frequency j
        sec = cfg.mrope_section
        if cfg.mrope_interleaved:
            axis[1:sec[1] * 3:3] = 1
            axis[2:sec[2] * 3:3] = 2
        else:  # contiguous sections (Qwen2-VL style)
            axis[sec[0]:sec[0] + sec[1]] = 1
            axis[sec[0] + sec[1]:] = 2
        self.axis = axis.to(device)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3 or 1, num_tokens] -> cos, sin [num_tokens, 1, head_dim / 2] (float32): one half
        of transformers' tables, whose two halves are equal; `apply_rotary` takes them."""
        if positions.shape[0] == 1:  # plain RoPE: the one row drives every frequency
            pos = positions.expand(self.axis.shape[0], -1)  # [half, N]
        else:
            pos = positions.gather(0, self.axis[:, None].expand(-1, positions.shape[1]))  # [half, N]
        freqs = (pos.t().float() * self.inv_freq)[:, None, :]  # [N, 1, half]
        return freqs.cos(), freqs.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] rotated by half-split RoPE with cos, sin [N, 1, D / 2]: transformers'
    `x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)`, the same products and sums per
    element, without the rotated copy of x or the doubled tables."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # q, k and v projections fused into one matmul (the loader stacks them).
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                residual: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] normed -> residual + attention output [N, hidden]."""
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        # q and k heads side by side ([N, Hq + Hkv, D], a view): normed and rotated together
        qk = qkv[:, :self.q_size + self.kv_size].view(n, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(n, self.num_kv_heads, self.head_dim)  # [N, Hkv, D]
        if self.qk_norm:
            qk = self._norm_qk(qk)
        qk = apply_rotary(qk, cos.to(qk.dtype), sin.to(qk.dtype))
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]  # [N, Hq, D], [N, Hkv, D]
        k_cache, v_cache = batch.kv_caches[self.layer_idx]
        batch.backend.store_kv(k, v, k_cache, v_cache, batch.attn_meta.slot_mapping)
        o = batch.backend.attention(q, k_cache, v_cache, batch.attn_meta, self.scale)  # [N, Hq, D]
        return linear_add(self.o_proj, o.reshape(n, self.q_size), residual)

    def _norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        """Per-head RMSNorm of [N, Hq + Hkv, D], q_norm's weight on the q heads and k_norm's on the k heads."""
        if qk.dtype != torch.float32:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            return torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        weight = torch.cat((self.q_norm.weight.expand(self.num_heads, -1),
                            self.k_norm.weight.expand(self.num_kv_heads, -1)))  # [Hq + Hkv, D]
        return F.rms_norm(qk, (self.head_dim,), None, self.q_norm.eps).mul_(weight)


class MLP(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] normed -> residual + MLP output [N, hidden]."""
        return linear_add(self.down_proj, swiglu(self.gate_up_proj, x, self.intermediate_size), residual)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.is_moe = layer_idx in cfg.moe_layer_ids
        self.mlp = SparseMoeBlock(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                                  cfg.num_experts_per_tok, cfg.norm_topk_prob) if self.is_moe else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, batch: ForwardBatch) -> torch.Tensor:
        # the residual adds ride on o_proj's and down_proj's calls where those are packed (cpu_linear.py)
        x = self.self_attn(self.input_layernorm(x), cos, sin, batch, residual=x)
        h = self.post_attention_layernorm(x)
        if self.is_moe:  # the fused Triton kernel where the attention runs in Triton too (GPU)
            return x + self.mlp(h, use_triton=batch.backend.name == "triton")
        return self.mlp(h, residual=x)


class Qwen3VLTextModel(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = unfilled_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = MRotaryEmbedding(cfg, device=self.embed_tokens.weight.device)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch,
                aux_layer_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids [num_tokens] -> (final hidden states [num_tokens, hidden], the residual
        stream entering each layer of `aux_layer_ids` (id 0: the embeddings), [num_tokens, hidden]
        each, in that order: what an EAGLE-3 head reads)."""
        x = self.embed_tokens(input_ids)
        if batch.mm_mask is not None:
            x[batch.mm_mask] = batch.mm_embeds.to(x.dtype)  # image placeholders take the ViT output
        cos, sin = self.rotary(batch.positions)
        deepstack = [batch.mm_extras[f"deepstack.{i}"] for i in range(len(batch.mm_extras))
                     if f"deepstack.{i}" in batch.mm_extras]
        aux = {}
        for i, layer in enumerate(self.layers):
            if i in aux_layer_ids:
                aux[i] = x.clone()  # deepstack adds into x in place
            x = layer(x, cos, sin, batch)
            if i < len(deepstack):
                x[batch.mm_mask] += deepstack[i].to(x.dtype)
        return self.norm(x), [aux[i] for i in aux_layer_ids]


class Qwen3VLForCausalLM(nn.Module):
    """Language model + output head. The vision tower lives in encoders/.

    `positions`: where its tokens sit (models/positions.py), the family's rule
    (registry.py) given by the loader; what the engine asks for a request's positions."""

    def __init__(self, cfg: TextConfig, positions: PositionRule | None = None):
        super().__init__()
        self.cfg = cfg
        self.positions = positions
        self.model = Qwen3VLTextModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, batch)[0]

    def forward_with_aux(self, input_ids: torch.Tensor, batch: ForwardBatch,
                         aux_layer_ids: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The forward, plus the residual stream entering the layers `aux_layer_ids` (see the text model)."""
        return self.model(input_ids, batch, aux_layer_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_samples, hidden] -> logits [num_samples, vocab] (float32)."""
        return self.lm_head(hidden).float()


def pack_cpu_linears(model: nn.Module) -> None:
    """CPU float32 (else nothing changes): every dense MLP's gate/up projection as a
    `PackedSwiGLU` (the activation and product inside oneDNN's calls), then every other
    `nn.Linear` packed whole (transport/weights/cpu_linear.py). After any LoRA wrapping: a wrapped
    gate/up is packed whole, its adapter added to the plain projection's output."""
    for module in model.modules():
        if isinstance(module, MLP):
            pack_swiglu(module, "gate_up_proj", module.intermediate_size)
    pack_linears(model)
