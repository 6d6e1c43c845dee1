"""`CausalLM`: what the engine uses of a family's language model, and nothing more.

A family builds its model over engine/layers/ (epd/families/<name>/text_model.py);
the runner, the KV-cache sizer, CUDA graphs and the proposers hold it as this.
`DecoderForCausalLM` is the usual way to meet it: a family's decoder stack plus
the output head; `DecoderStack` is that stack where every layer takes one rotary table.
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from epd.engine.layers.forward_batch import ForwardBatch
from epd.engine.models.positions import PositionRule


class TextShape(Protocol):
    """The sizes the engine reads: KV-cache geometry, logits, hidden states."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int


class CausalLM(Protocol):
    cfg: TextShape
    positions: PositionRule  # where its tokens sit (models/positions.py)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids [num_tokens] -> final hidden states [num_tokens, hidden]."""

    def forward_with_aux(self, input_ids: torch.Tensor, batch: ForwardBatch,
                         aux_layer_ids: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The forward, plus the residual stream entering each layer of `aux_layer_ids`
        (id 0: the embeddings), [num_tokens, hidden] each: what an EAGLE-3 head reads."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_samples, hidden] -> logits [num_samples, vocab] (float32)."""


def num_kv_layers(model) -> int:
    """How many of the model's layers hold paged KV: every layer, unless the model says fewer with
    a `num_kv_layers` attribute (Qwen3.5: its full-attention layers; its Gated DeltaNet layers carry
    per-request state instead), whose attention layers then index `ForwardBatch.kv_caches` by their
    place among the KV-holding ones. The KV cache, its block budget and the hand-over hold those only."""
    return getattr(model, "num_kv_layers", model.cfg.num_layers)


class DecoderStack(nn.Module):
    """A decoder stack whose layers take (x, cos, sin, batch): the token embeddings with the image
    rows put in place, one rotary table for every layer, the layers, the final norm. A family
    builds the pieces (its `text_model.py`) and hands them over; their names are the checkpoint's."""

    def __init__(self, cfg, embed_tokens: nn.Module, layers: nn.ModuleList, norm: nn.Module, rotary):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = embed_tokens
        self.layers = layers
        self.norm = norm
        self.rotary = rotary

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch,
                aux_layer_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids [num_tokens] -> (final hidden states [num_tokens, hidden], the residual
        stream entering each layer of `aux_layer_ids` (id 0: the embeddings; id num_layers: after the
        last layer, before the final norm, what MTP layers read), [num_tokens, hidden] each)."""
        x = self.embed_tokens(input_ids)
        if batch.mm_mask is not None:
            x[batch.mm_mask] = batch.mm_embeds.to(x.dtype)  # image placeholders take the vision output
        cos, sin = self.rotary(batch.positions)
        aux = {}
        for i, layer in enumerate(self.layers):
            if i in aux_layer_ids:
                aux[i] = x  # the layers make new tensors: nothing writes into it
            x = layer(x, cos, sin, batch)
        aux[len(self.layers)] = x  # id num_layers: the stream after the last layer, before the final norm
        return self.norm(x), [aux[i] for i in aux_layer_ids]


class DecoderForCausalLM(nn.Module):
    """A family's decoder (`model`: input_ids, batch, aux_layer_ids -> (final hidden states,
    the residual stream entering each aux layer)) and its output head `lm_head`.

    `positions`: where its tokens sit, the family's rule (given by its loader)."""

    def __init__(self, cfg: TextShape, model: nn.Module, positions: PositionRule | None = None):
        super().__init__()
        self.cfg = cfg
        self.positions = positions
        self.model = model
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, batch)[0]

    def forward_with_aux(self, input_ids: torch.Tensor, batch: ForwardBatch,
                         aux_layer_ids: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The forward, plus the residual stream entering the layers `aux_layer_ids` (id 0: the embeddings)."""
        return self.model(input_ids, batch, aux_layer_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_samples, hidden] -> logits [num_samples, vocab] (float32)."""
        return self.lm_head(hidden).float()
