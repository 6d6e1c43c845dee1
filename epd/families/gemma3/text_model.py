"""Gemma 3's language model on a paged KV cache, over the shared layers of engine/layers/.

Gemma 3 decoder layers: Gemma's RMSNorm (x * (1 + w)) everywhere, per-head
q/k norms, sandwich norms (the attention's and the MLP's outputs are normed
before each residual sum), a GELU-tanh gated MLP, the softmax scaled by
query_pre_attn_scalar^-0.5. Layers are "sliding_attention" (local: a window of
`sliding_window` keys, rotary base `rope_local_base_freq`) or
"full_attention" (global: rotary base `rope_theta`, with the config's linear
rope scaling), as `layer_types` lists them (the releases: five local per
global). An image's tokens see each other both ways (`bidirectional_mm`: the
engine passes its spans as bidirectional ranges and never ends a prefill chunk
inside one), within the window on local layers. Token embeddings are scaled by
sqrt(hidden) (rounded to the weights' dtype, as transformers does), the image's
embeddings replace its placeholder tokens after that scaling; the head is tied
to the embeddings; the final logits are soft-capped when the config says so.
Positions are plain 1-D RoPE.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from epd.engine.layers.attention import Attention
from epd.engine.layers.forward_batch import ForwardBatch
from epd.engine.layers.norm import RMSNorm
from epd.engine.layers.rotary import RotaryEmbedding
from epd.engine.layers.softcap import softcap
from epd.engine.models.causal_lm import DecoderForCausalLM
from epd.engine.models.positions import PositionRule
from epd.transport.weights.checkpoint import unfilled_embedding

SLIDING, FULL = "sliding_attention", "full_attention"


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
    query_pre_attn_scalar: float
    sliding_window: int
    layer_types: tuple[str, ...]  # SLIDING or FULL, one per layer
    rope_theta: float  # global layers
    rope_scaling_factor: float  # global layers' linear scaling (1.0: none)
    rope_local_base_freq: float  # sliding layers
    max_position_embeddings: int
    final_logit_softcapping: float | None = None
    moe_layer_ids: tuple[int, ...] = ()  # none: every MLP is dense (what LoRA's shapes ask)

    @classmethod
    def from_hf(cls, hf_config) -> "TextConfig":
        """Our config from transformers' Gemma3Config (or its text config); ValueError naming what
        a checkpoint asks that is not served."""
        tc = getattr(hf_config, "text_config", hf_config)
        if tc.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(f"Gemma 3 hidden_activation {tc.hidden_activation!r}: only gelu_pytorch_tanh is served")
        if getattr(tc, "attn_logit_softcapping", None) is not None:  # transformers ignores it, vLLM applies it
            raise ValueError("Gemma 3 attn_logit_softcapping is not supported (the releases have none)")
        if getattr(tc, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 use_bidirectional_attention (an embedding model) is not served")
        if getattr(tc, "attention_bias", False):
            raise ValueError("Gemma 3 attention_bias is not supported (the releases have none)")
        rope = tc.rope_parameters
        local, full = rope[SLIDING], rope[FULL]
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"Gemma 3 sliding layers' rope_type {local['rope_type']!r}: only default is served")
        if full.get("rope_type", "default") not in ("default", "linear"):
            raise ValueError(f"Gemma 3 rope_type {full['rope_type']!r}: default or linear is served")
        factor = float(full.get("factor", 1.0)) if full.get("rope_type") == "linear" else 1.0
        types = tuple(tc.layer_types)
        if set(types) - {SLIDING, FULL} or len(types) != tc.num_hidden_layers:
            raise ValueError(f"Gemma 3 layer_types {types!r}: one of {SLIDING}, {FULL} per layer")
        return cls(
            vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
            num_layers=tc.num_hidden_layers, num_heads=tc.num_attention_heads,
            num_kv_heads=tc.num_key_value_heads, head_dim=tc.head_dim, rms_norm_eps=tc.rms_norm_eps,
            query_pre_attn_scalar=float(tc.query_pre_attn_scalar), sliding_window=int(tc.sliding_window),
            layer_types=types, rope_theta=float(full["rope_theta"]), rope_scaling_factor=factor,
            rope_local_base_freq=float(local["rope_theta"]), max_position_embeddings=tc.max_position_embeddings,
            final_logit_softcapping=getattr(tc, "final_logit_softcapping", None),
        )


def rotary_embeddings(cfg: TextConfig, device: str | torch.device = "cpu") -> dict[str, RotaryEmbedding]:
    """One 1-D rotary embedding per layer type: the local base, and the global one with its linear
    scaling (transformers divides the inverse frequencies by the factor)."""
    return {SLIDING: RotaryEmbedding(cfg.head_dim, cfg.rope_local_base_freq, device=device),
            FULL: RotaryEmbedding(cfg.head_dim, cfg.rope_theta, device=device, factor=cfg.rope_scaling_factor)}


class GeluMLP(nn.Module):
    """gelu_tanh(gate(x)) * up(x) -> down, gate and up in one fused projection."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class DecoderLayer(nn.Module):
    is_moe = False  # a dense MLP: LoRA wraps its gate/up and down projections

    def __init__(self, cfg: TextConfig, layer_idx: int):
        super().__init__()
        self.layer_type = cfg.layer_types[layer_idx]
        window = cfg.sliding_window if self.layer_type == SLIDING else None  # local: the last W keys
        self.self_attn = Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, layer_idx,
                                   cfg.rms_norm_eps, sliding_window=window, norm_unit_offset=True,
                                   scale=cfg.query_pre_attn_scalar ** -0.5)
        self.mlp = GeluMLP(cfg.hidden_size, cfg.intermediate_size)
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=True)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, batch, residual=None)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3TextModel(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = unfilled_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=True)
        self.rotary = rotary_embeddings(cfg, device=self.embed_tokens.weight.device)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch,
                aux_layer_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids [num_tokens] -> (final hidden states [num_tokens, hidden], the residual stream
        entering each layer of `aux_layer_ids`, [num_tokens, hidden] each: what an EAGLE-3 head reads)."""
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(math.sqrt(self.cfg.hidden_size), dtype=x.dtype).item()  # rounded to the dtype
        if batch.mm_mask is not None:
            x[batch.mm_mask] = batch.mm_embeds.to(x.dtype)  # image placeholders take the projector's output
        tables = {kind: rotary(batch.positions) for kind, rotary in self.rotary.items()}  # cos, sin per type
        aux = {}
        for i, layer in enumerate(self.layers):
            if i in aux_layer_ids:
                aux[i] = x  # each layer makes a new x: nothing writes into this one
            x = layer(x, *tables[layer.layer_type], batch)
        return self.norm(x), [aux[i] for i in aux_layer_ids]


class Gemma3ForCausalLM(DecoderForCausalLM):
    """Language model + tied output head (the vision side is vision.py's).

    `positions`: where its tokens sit (engine/models/positions.py RopePositions), given by the
    loader; what the engine asks for a request's positions."""

    bidirectional_mm = True  # an image's tokens attend to each other both ways (the engine asks)

    def __init__(self, cfg: TextConfig, positions: PositionRule | None = None):
        super().__init__(cfg, Gemma3TextModel(cfg), positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_samples, hidden] -> logits [num_samples, vocab] (float32), soft-capped
        (cap * tanh(logits / cap)) when the config has `final_logit_softcapping`."""
        return softcap(self.lm_head(hidden).float(), self.cfg.final_logit_softcapping)
