"""Qwen3-VL language model on a paged KV cache (and its relatives, by config).

Qwen3 decoder layers (q/k RMSNorm per head, GQA, SwiGLU MLP) with interleaved
multimodal RoPE and deepstack injection: the vision tower's intermediate
features are added to the hidden states of image tokens after the first
`num_deepstack` layers. The same modules serve Qwen3-VL-MoE (sparse MoE
blocks in `moe_layer_ids`, layers/moe.py) and Qwen2.5-VL (q/k/v biases, no
q/k norm, contiguous M-RoPE sections, no deepstack); epd/families/registry.py
maps each family's config onto `TextConfig`. Built from the shared layers of
engine/layers/. Tokens arrive flattened `[num_tokens]` for a whole engine
step (prefill chunks and decodes mixed); attention reads and writes the paged
cache through the backend in the `ForwardBatch`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from epd.engine.layers.attention import Attention
from epd.engine.layers.forward_batch import ForwardBatch
from epd.engine.layers.mlp import MLP
from epd.engine.layers.moe import SparseMoeBlock, add_mlp
from epd.engine.layers.norm import RMSNorm
from epd.engine.layers.rotary import RotaryEmbedding
from epd.engine.models.causal_lm import DecoderForCausalLM
from epd.engine.models.positions import PositionRule
from epd.transport.weights.checkpoint import unfilled_embedding


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


def rotary_embedding(cfg: TextConfig, device: str | torch.device = "cpu") -> RotaryEmbedding:
    """The text model's M-RoPE: `mrope_section` frequencies per position row, interleaved or not."""
    return RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.mrope_section, cfg.mrope_interleaved, device)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, layer_idx,
                                   cfg.rms_norm_eps, bias=cfg.attention_bias, qk_norm=cfg.qk_norm)
        self.is_moe = layer_idx in cfg.moe_layer_ids
        if self.is_moe:
            self.mlp = SparseMoeBlock(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                                      cfg.num_experts_per_tok, cfg.norm_topk_prob)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, batch: ForwardBatch) -> torch.Tensor:
        # the residual adds ride on o_proj's and down_proj's calls where those are packed (cpu_linear.py)
        x = self.self_attn(self.input_layernorm(x), cos, sin, batch, residual=x)
        return add_mlp(self.mlp, self.post_attention_layernorm(x), x, batch)


class Qwen3VLTextModel(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = unfilled_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = rotary_embedding(cfg, device=self.embed_tokens.weight.device)

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


class Qwen3VLForCausalLM(DecoderForCausalLM):
    """Language model + output head (the vision side is vision.py's).

    `positions`: where its tokens sit (positions.py: M-RoPE), given by the loader;
    what the engine asks for a request's positions."""

    def __init__(self, cfg: TextConfig, positions: PositionRule | None = None):
        super().__init__(cfg, Qwen3VLTextModel(cfg), positions)
