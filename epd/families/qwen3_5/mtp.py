"""Qwen3.5's multi-token-prediction (MTP) layers, the release's `mtp.*` tensors, as a draft head.

vLLM's `qwen3_5_mtp` (and `qwen3_next_mtp`) forward, which the releases are trained for: at a
position it takes the target's final hidden state h (after the final norm) and the embedding e
of the next token, and predicts the token after that:

    x = fc(cat(pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)))     fc: [2 * hidden] -> hidden
    x = one full-attention decoder layer of the target's own kind (gated attention, partial
        rotary, the target's MLP), over the MTP layer's own KV
    normed = norm(x); logits = the target's lm_head(normed)

The embedding and the head are the target's (the releases hold no copy). Drafting k tokens
feeds `normed` back as h with the token just drafted, as vLLM does. Tensors: `mtp.fc.weight`,
`mtp.pre_fc_norm_embedding.weight`, `mtp.pre_fc_norm_hidden.weight`, `mtp.norm.weight`,
`mtp.layers.0.*` (the layer's names as the text model's layers: `self_attn.q_proj` with the
gate rows, `k_proj`, `v_proj`, `o_proj`, `q_norm`, `k_norm`, `mlp.*`, the two layer norms); the
text config's `mtp_num_hidden_layers` says how many layers (the releases: 1, the one served).

text_loader.py `load_mtp_head` fills it (the text model's naming rules, under `mtp.`).
`MTPHead` has the draft-head interface the engine's EAGLE-3 proposer drives
(engine/spec/eagle3_proposer.py): `combine` (the target's states at `aux_layer_ids` -> h),
`forward(hidden, embeds, positions, attend)` -> (normed, hidden to feed back), `compute_logits`;
its `attend` is that proposer's paged KV. The layer's attention runs through the engine's own
attention layer with an attention backend over `attend` (`_AttendBackend`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

from epd.engine.layers.forward_batch import ForwardBatch
from epd.engine.layers.norm import RMSNorm
from epd.families.qwen3_5.text_model import FULL, DecoderLayer, Qwen3_5ForCausalLM, TextConfig

PREFIX = "mtp."


@dataclass(frozen=True)
class MTPShape:
    """What the proposer sizes its paged KV by, and which target state it reads: the residual
    stream after the target's last layer (`aux_layer_ids` = (num target layers,))."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    aux_layer_ids: tuple[int, ...]


class _AttendBackend:
    """The engine's attention backend interface (`store_kv`, `attention`) over an `attend`
    callback: the layer's new K/V go to `attend` with its queries (it stores and attends)."""

    name = "torch"

    def __init__(self, attend):
        self.attend = attend

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        self._k, self._v = k, v

    def attention(self, q, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
        return self.attend(0, q, self._k, self._v, scale)


class MTPHead(nn.Module):
    """The MTP modules (named as `mtp.*` without the prefix) over the target's embedding, final
    norm and head (held, not registered: they are the target's weights)."""

    def __init__(self, cfg: TextConfig, target: Qwen3_5ForCausalLM):
        super().__init__()
        layer_cfg = dataclasses.replace(cfg, num_layers=1, layer_types=(FULL,))
        self.cfg = MTPShape(1, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, (cfg.num_layers,))
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=True)
        self.pre_fc_norm_hidden = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=True)
        self.layers = nn.ModuleList([DecoderLayer(layer_cfg, 0)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=True)
        self._target = (target,)  # a tuple: not a submodule
        self.embed_tokens = None  # the target's (the proposer takes it then)
        self.rotary = None  # set by the loader on the head's device (float32 tables, not weights)

    def combine(self, aux_hidden_states) -> torch.Tensor:
        """[the residual stream after the target's last layer [N, hidden]] -> h, the final-normed state."""
        (last,) = aux_hidden_states
        return self._target[0].model.norm(last)

    def forward(self, hidden: torch.Tensor, input_embeds: torch.Tensor, positions: torch.Tensor,
                attend) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [N, hidden] (h, or the previous step's output), input_embeds [N, hidden] (the next
        tokens'), positions [N] -> (normed [N, hidden], the same to feed back)."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(input_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        cos, sin = self.rotary(positions[None])
        batch = ForwardBatch(positions=positions[None], attn_meta=SimpleNamespace(slot_mapping=None),
                             backend=_AttendBackend(attend),
                             kv_caches=[(None, None)])
        x = self.layers[0](x, cos, sin, batch)
        normed = self.norm(x)
        return normed, normed

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32: the target's head."""
        return self._target[0].compute_logits(normed)


def num_mtp_layers(hf_config) -> int:
    """The text config's `mtp_num_hidden_layers` (0: none declared)."""
    tc = getattr(hf_config, "text_config", hf_config)
    return int(getattr(tc, "mtp_num_hidden_layers", 0) or 0)
