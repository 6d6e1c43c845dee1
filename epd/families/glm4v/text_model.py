"""GLM-4.1V's and GLM-4.5V's language models on a paged KV cache (transformers'
Glm4vTextModel and Glm4vMoeTextModel), one decoder with their differences as options.

GLM-4.1V: GLM-4 decoder layers with q/k/v biases, no q/k norm, head_dim =
hidden / heads, GQA; "sandwich" norms, the attention's and the MLP's outputs
each RMS-normed (post_self_attn_layernorm, post_mlp_layernorm) before their
residual add; a SwiGLU MLP whose gate/up projection the checkpoint already
fuses. Rotary: only the first `rotary_dim` = head_dim x partial_rotary_factor
dims of a head rotate, as adjacent pairs (2j with 2j + 1, not halves as
Qwen), frequency j driven by the t, h or w position row in contiguous
`mrope_section` blocks. GLM-4.5V (`glm4v_moe`): plain pre-norm layers, the
config's head_dim, rotary on halves (same partial dims and sections), and
after `first_k_dense_replace` dense layers a grouped-routing MoE with shared
experts (layers/moe.py `GroupedMoeBlock`). Built from engine/layers/; tokens
arrive flattened `[num_tokens]` for a whole engine step, image embeddings in
the `ForwardBatch` replace their placeholders.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from epd.engine.layers.attention import Attention
from epd.engine.layers.forward_batch import ForwardBatch
from epd.engine.layers.mlp import MLP
from epd.engine.layers.moe import GroupedMoeBlock, add_mlp
from epd.engine.layers.norm import RMSNorm
from epd.engine.layers.rotary import RotaryEmbedding
from epd.engine.models.causal_lm import DecoderForCausalLM, DecoderStack
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
    rotary_dim: int  # the leading dims of a head that rotate
    mrope_section: tuple[int, int, int]  # frequencies driven by the t, h, w rows: sum = rotary_dim / 2
    tie_word_embeddings: bool
    max_position_embeddings: int
    post_norms: bool = True  # the sandwich norms (GLM-4.1V)
    rotary_pairs: bool = True  # rotary on adjacent pairs (GLM-4.1V), else on halves (GLM-4.5V)
    attention_bias: bool = True
    # GLM-4.5V's MoE: the layers whose MLP is routed, and their router
    moe_layer_ids: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    num_expert_groups: int = 1
    topk_expert_groups: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True

    @classmethod
    def from_hf(cls, hf_config) -> TextConfig:
        """Our config from a transformers Glm4vConfig or Glm4vMoeConfig; ValueError for what we cannot run."""
        tc = hf_config.text_config
        moe = hf_config.model_type == "glm4v_moe"
        rope = dict(getattr(tc, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"{hf_config.model_type} with rope_type {rope.get('rope_type')!r} is not supported")
        head_dim = tc.hidden_size // tc.num_attention_heads  # what GLM-4.1V's attention uses, whatever head_dim says
        if moe:
            head_dim = getattr(tc, "head_dim", None) or head_dim
        rotary_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        section = tuple(rope.get("mrope_section", (8, 12, 12)))
        if len(section) != 3 or 2 * sum(section) != rotary_dim:
            raise ValueError(f"mrope_section {list(section)} does not cover the {rotary_dim} rotary dims")
        cfg = cls(
            vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
            num_layers=tc.num_hidden_layers, num_heads=tc.num_attention_heads,
            num_kv_heads=tc.num_key_value_heads or tc.num_attention_heads, head_dim=head_dim,
            rms_norm_eps=tc.rms_norm_eps, rope_theta=float(rope.get("rope_theta", 10000.0)), rotary_dim=rotary_dim,
            mrope_section=section, tie_word_embeddings=bool(hf_config.tie_word_embeddings),
            max_position_embeddings=tc.max_position_embeddings,
        )
        if not moe:
            return cfg
        if tc.n_routed_experts % tc.n_group or tc.topk_group > tc.n_group:
            raise ValueError(f"{tc.n_routed_experts} experts in {tc.n_group} groups, {tc.topk_group} chosen: "
                             "not a grouping")
        return dataclasses.replace(
            cfg, post_norms=False, rotary_pairs=False, attention_bias=bool(tc.attention_bias),
            moe_layer_ids=tuple(range(tc.first_k_dense_replace, tc.num_hidden_layers)),
            num_experts=tc.n_routed_experts, num_experts_per_tok=tc.num_experts_per_tok,
            moe_intermediate_size=tc.moe_intermediate_size, num_shared_experts=tc.n_shared_experts,
            num_expert_groups=tc.n_group, topk_expert_groups=tc.topk_group,
            routed_scaling_factor=float(tc.routed_scaling_factor), norm_topk_prob=bool(tc.norm_topk_prob),
        )


def rotary_embedding(cfg: TextConfig, device: str | torch.device = "cpu") -> RotaryEmbedding:
    """M-RoPE over the rotary dims: contiguous t, h, w blocks of frequencies."""
    return RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.mrope_section, interleaved=False, device=device,
                           rotary_dim=cfg.rotary_dim)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, layer_idx,
                                   cfg.rms_norm_eps, bias=cfg.attention_bias, qk_norm=False,
                                   rotary_dim=cfg.rotary_dim, rotary_pairs=cfg.rotary_pairs)
        self.is_moe = layer_idx in cfg.moe_layer_ids
        if self.is_moe:
            self.mlp = GroupedMoeBlock(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                                       cfg.num_experts_per_tok, cfg.num_shared_experts, cfg.num_expert_groups,
                                       cfg.topk_expert_groups, cfg.norm_topk_prob, cfg.routed_scaling_factor)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_norms = cfg.post_norms
        if cfg.post_norms:
            self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if self.post_norms:  # GLM-4.1V: each output normed before its residual add
            x = x + self.post_self_attn_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, batch, None))
            return x + self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(x)))
        # the residual adds ride on o_proj's and down_proj's calls where those are packed (cpu_linear.py)
        x = self.self_attn(self.input_layernorm(x), cos, sin, batch, residual=x)
        return add_mlp(self.mlp, self.post_attention_layernorm(x), x, batch)


class Glm4vTextModel(DecoderStack):
    def __init__(self, cfg: TextConfig):
        embed_tokens = unfilled_embedding(cfg.vocab_size, cfg.hidden_size)
        super().__init__(cfg, embed_tokens, nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers)),
                         RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), rotary_embedding(cfg, device=embed_tokens.weight.device))


class Glm4vForCausalLM(DecoderForCausalLM):
    """Language model + output head (the vision tower is the encoder side's: vision.py).

    `positions`: where its tokens sit (positions.py), what the engine asks for a request's positions."""

    def __init__(self, cfg: TextConfig, positions: PositionRule | None = None):
        super().__init__(cfg, Glm4vTextModel(cfg), positions)
