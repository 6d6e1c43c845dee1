"""Qwen3.5's language model (dense and MoE): Gated DeltaNet layers and gated full attention.

`layer_types` says each layer's token mixer: "linear_attention" (layers/gated_deltanet.py, a
per-request recurrent and conv state) or "full_attention": the paged attention with q/k
RMSNorm (1 + w), rotary on the first quarter of each head (interleaved M-RoPE sections) and an
output gate, sigmoid(gate) per head from the second half of each head's q_proj rows. Every norm is the
(1 + w) RMSNorm. The MLP is dense SwiGLU, or (qwen3_5_moe) routed experts plus a shared expert
scaled by sigmoid(shared_expert_gate(x)). Tokens arrive flattened `[num_tokens]` for a whole
engine step, as in every family's model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from epd.engine.layers.attention import Attention
from epd.engine.layers.forward_batch import ForwardBatch
from epd.engine.layers.gated_deltanet import GatedDeltaNet
from epd.engine.layers.mlp import MLP
from epd.engine.layers.moe import SparseMoeBlock, add_mlp
from epd.engine.layers.norm import RMSNorm
from epd.engine.layers.rotary import RotaryEmbedding
from epd.engine.models.causal_lm import DecoderForCausalLM, DecoderStack
from epd.engine.models.positions import PositionRule
from epd.transport.weights.checkpoint import unfilled_embedding

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # head_dim x partial_rotary_factor
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]
    tie_word_embeddings: bool
    max_position_embeddings: int
    layer_types: tuple[str, ...]
    # Gated DeltaNet layers
    linear_num_k_heads: int
    linear_num_v_heads: int
    linear_k_dim: int
    linear_v_dim: int
    linear_conv_kernel: int
    # qwen3_5_moe: every layer's MLP is routed experts plus a shared expert
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    @classmethod
    def from_hf(cls, hf_config) -> "TextConfig":
        tc = getattr(hf_config, "text_config", hf_config)
        rope = dict(getattr(tc, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") not in ("default", "mrope"):
            raise ValueError(f"unsupported rope_type {rope.get('rope_type')!r}")
        if not rope.get("mrope_interleaved", True):
            raise ValueError("Qwen3.5's M-RoPE is interleaved; mrope_interleaved false is not supported")
        layer_types = tuple(tc.layer_types)
        unknown = sorted(set(layer_types) - {LINEAR, FULL})
        if unknown or len(layer_types) != tc.num_hidden_layers:
            raise ValueError(f"layer_types must give {LINEAR!r} or {FULL!r} for each of the "
                             f"{tc.num_hidden_layers} layers, got {list(layer_types)}")
        if getattr(tc, "attention_bias", False):
            raise ValueError("attention_bias is not supported for Qwen3.5")
        if not getattr(tc, "attn_output_gate", True):
            raise ValueError("Qwen3.5's full attention has a gated output; attn_output_gate false is not supported")
        if getattr(tc, "mlp_only_layers", None):
            raise ValueError(f"mlp_only_layers {list(tc.mlp_only_layers)}: every Qwen3.5-MoE layer is routed here; "
                             "dense layers among them are not supported")
        head_dim = tc.head_dim or tc.hidden_size // tc.num_attention_heads
        tie = getattr(hf_config, "tie_word_embeddings", None)
        is_moe = getattr(tc, "num_experts", 0) > 0
        return cls(
            vocab_size=tc.vocab_size, hidden_size=tc.hidden_size,
            intermediate_size=getattr(tc, "intermediate_size", 0) or 0, num_layers=tc.num_hidden_layers,
            num_heads=tc.num_attention_heads, num_kv_heads=tc.num_key_value_heads, head_dim=head_dim,
            rotary_dim=int(head_dim * rope.get("partial_rotary_factor", 0.25)), rms_norm_eps=tc.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", 10_000_000.0)),
            mrope_section=tuple(rope.get("mrope_section", (11, 11, 10))),
            tie_word_embeddings=bool(tc.tie_word_embeddings if tie is None else tie),
            max_position_embeddings=tc.max_position_embeddings, layer_types=layer_types,
            linear_num_k_heads=tc.linear_num_key_heads, linear_num_v_heads=tc.linear_num_value_heads,
            linear_k_dim=tc.linear_key_head_dim, linear_v_dim=tc.linear_value_head_dim,
            linear_conv_kernel=tc.linear_conv_kernel_dim,
            num_experts=tc.num_experts if is_moe else 0,
            num_experts_per_tok=tc.num_experts_per_tok if is_moe else 0,
            moe_intermediate_size=tc.moe_intermediate_size if is_moe else 0,
            shared_expert_intermediate_size=tc.shared_expert_intermediate_size if is_moe else 0,
        )

    @property
    def attn_output_gate(self) -> bool:
        """q_proj gives each head's query and its output gate (from_hf refuses a config without the gate)."""
        return True

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """qwen3_5_moe: every layer's MLP is routed (from_hf refuses mlp_only_layers)."""
        return tuple(range(self.num_layers)) if self.num_experts else ()

    @property
    def linear_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        """The full-attention layers: the only ones holding KV (`ForwardBatch.kv_caches` in this order)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)


def rotary_embedding(cfg: TextConfig, device: str | torch.device = "cpu") -> RotaryEmbedding:
    """Interleaved M-RoPE on the first `rotary_dim` dims of each head."""
    return RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.mrope_section, True, device, rotary_dim=cfg.rotary_dim)


class GatedAttention(Attention):
    """The paged attention with an output gate: q_proj gives each head's query and its gate side by
    side ([N, heads, 2 x head_dim]); the output is attention x sigmoid(gate) before o_proj."""

    def __init__(self, cfg: TextConfig, layer_idx: int):
        super().__init__(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, layer_idx,
                         cfg.rms_norm_eps, norm_unit_offset=True, rotary_dim=cfg.rotary_dim)
        self.qkv_proj = nn.Linear(cfg.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        n, q_size, kv_size = x.shape[0], self.q_size, self.kv_size
        qkv = self.qkv_proj(x)
        q_gate = qkv[:, :2 * q_size].view(n, self.num_heads, 2 * self.head_dim)
        q, gate = q_gate[..., :self.head_dim], q_gate[..., self.head_dim:]  # [N, Hq, D] each
        k = qkv[:, 2 * q_size:2 * q_size + kv_size].view(n, self.num_kv_heads, self.head_dim)
        v = qkv[:, 2 * q_size + kv_size:].view(n, self.num_kv_heads, self.head_dim)
        qk = self._norm_qk(torch.cat((q, k), dim=1))  # [N, Hq + Hkv, D]
        qk = self._rotate(qk, cos.to(qk.dtype), sin.to(qk.dtype))
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        k_cache, v_cache = batch.kv_caches[self.layer_idx]
        batch.backend.store_kv(k, v, k_cache, v_cache, batch.attn_meta.slot_mapping)
        o = batch.backend.attention(q, k_cache, v_cache, batch.attn_meta, self.scale)  # [N, Hq, D]
        o = o.reshape(n, q_size) * torch.sigmoid(gate.reshape(n, q_size))
        out = self.o_proj(o)
        return out if residual is None else residual + out


class SharedExpertMoe(nn.Module):
    """Routed experts (softmax, top-k, renormalised) plus a shared expert gated per token."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.experts = SparseMoeBlock(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                                      cfg.num_experts_per_tok, normalize=True)
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, use_triton: bool = False) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]."""
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.experts(x, use_triton=use_triton) + shared


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int):
        super().__init__()
        self.is_linear = cfg.layer_types[layer_idx] == LINEAR
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg.hidden_size, cfg.linear_num_k_heads, cfg.linear_num_v_heads,
                                             cfg.linear_k_dim, cfg.linear_v_dim, cfg.linear_conv_kernel,
                                             cfg.rms_norm_eps, cfg.linear_layer_ids.index(layer_idx))
        else:
            self.self_attn = GatedAttention(cfg, cfg.full_layer_ids.index(layer_idx))  # its KV's place
        self.is_moe = cfg.num_experts > 0
        self.mlp = SharedExpertMoe(cfg) if self.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=True)

    def forward(self, x, cos, sin, batch: ForwardBatch) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = x + (self.linear_attn(h, batch) if self.is_linear else self.self_attn(h, cos, sin, batch))
        return add_mlp(self.mlp, self.post_attention_layernorm(x), x, batch)


class Qwen3_5TextModel(DecoderStack):
    def __init__(self, cfg: TextConfig):
        embed_tokens = unfilled_embedding(cfg.vocab_size, cfg.hidden_size)
        super().__init__(cfg, embed_tokens, nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers)),
                         RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=True), rotary_embedding(cfg, device=embed_tokens.weight.device))


class Qwen3_5ForCausalLM(DecoderForCausalLM):
    """Language model + output head. `state_shapes()`: per Gated DeltaNet layer, one request's
    (conv state, recurrent state) shapes: what the engine's state cache holds per slot;
    `num_kv_layers`: the full-attention layers, the only ones holding paged KV; `load_mtp_head`
    (set by text_loader.py): the release's MTP layers, for speculative decoding's method mtp."""

    def __init__(self, cfg: TextConfig, positions: PositionRule | None = None):
        super().__init__(cfg, Qwen3_5TextModel(cfg), positions)
        self.num_kv_layers = len(cfg.full_layer_ids)

    def state_shapes(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [layer.linear_attn.state_shapes() for layer in self.model.layers if layer.is_linear]
