"""`Eagle3Config`: an EAGLE-3 head's config.json (Speculators' format, or EAGLE's flat
one), typed, and `check_fits`: whether the head drafts for a given target. Pure Python
(no torch): the CLI checks a head against the target before any worker starts
(engine/spec/check.py), the worker checks it again when it loads the weights
(engine/spec/eagle3_proposer.py load_head). The head itself: engine/spec/eagle3.py."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Eagle3Config:
    """What the head's shapes and wiring need, read from its config.json."""

    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_layers: int  # the head's own decoder layers (published heads: 1)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # the target's
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]  # target layers whose input residual stream is read, ascending
    num_speculative_tokens: int
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    qk_norm: bool = False  # Qwen3 layer config: RMSNorm per head on q and k
    attention_bias: bool = False
    model_type: str = "llama"
    verifier: str | None = None  # speculators_config.verifier.name_or_path

    @classmethod
    def from_dict(cls, cfg: dict, target_num_layers: int | None = None) -> Eagle3Config:
        """Speculators' config.json (or EAGLE's flat one). Without
        eagle_aux_hidden_state_layer_ids, Speculators' default ids need the
        target's number of layers."""
        layer = cfg.get("transformer_layer_config") or cfg
        model_type = layer.get("model_type", "llama")
        if model_type not in ("llama", "qwen3"):
            raise ValueError(f"EAGLE-3 head: unsupported transformer_layer_config model_type {model_type!r}")
        if layer.get("hidden_act", "silu") != "silu":
            raise ValueError(f"EAGLE-3 head: unsupported hidden_act {layer.get('hidden_act')!r}")
        rope = dict(layer.get("rope_parameters") or {})
        rope.update(layer.get("rope_scaling") or {})
        if rope.get("rope_type", rope.get("type", "default")) != "default" or "mrope_section" in rope:
            raise ValueError(f"EAGLE-3 head: only default RoPE is supported, got {rope}")
        ids = cfg.get("eagle_aux_hidden_state_layer_ids")
        if not ids:
            if target_num_layers is None:
                raise ValueError("EAGLE-3 head names no eagle_aux_hidden_state_layer_ids: "
                                 "the target's number of layers is needed for the default")
            ids = [2, target_num_layers // 2, target_num_layers - 3]
        too_deep = target_num_layers is not None and max(ids) > target_num_layers
        if len(set(ids)) != len(ids) or min(ids) < 0 or too_deep:
            raise ValueError(f"EAGLE-3 head: invalid aux layer ids {ids} for {target_num_layers} target layers")
        hidden = layer["hidden_size"]
        proposals = (cfg.get("speculators_config") or {}).get("proposal_methods") or [{}]
        verifier = ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        return cls(
            hidden_size=hidden, target_hidden_size=cfg.get("target_hidden_size") or hidden,
            intermediate_size=layer["intermediate_size"], num_layers=layer.get("num_hidden_layers", 1),
            num_heads=layer["num_attention_heads"],
            num_kv_heads=layer.get("num_key_value_heads") or layer["num_attention_heads"],
            head_dim=layer.get("head_dim") or hidden // layer["num_attention_heads"],
            rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", layer.get("rope_theta", 10000.0))),
            vocab_size=layer["vocab_size"], draft_vocab_size=cfg.get("draft_vocab_size") or layer["vocab_size"],
            aux_layer_ids=tuple(sorted(ids)), num_speculative_tokens=proposals[0].get("speculative_tokens", 3),
            norm_before_residual=bool(cfg.get("norm_before_residual", False)),
            norm_before_fc=bool(cfg.get("norm_before_fc", False)), fc_norm=bool(cfg.get("fc_norm", False)),
            norm_output=bool(cfg.get("norm_output", False)), qk_norm=model_type == "qwen3",
            attention_bias=bool(layer.get("attention_bias", False)), model_type=model_type, verifier=verifier,
        )

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    def check_fits(self, path, hidden_size: int, vocab_size: int, num_layers: int) -> None:
        """ValueError naming what does not fit a target of `hidden_size`, `vocab_size`
        and `num_layers` (the head at `path` was trained for another target)."""
        if self.target_hidden_size != hidden_size or self.vocab_size != vocab_size:
            raise ValueError(f"--speculative-config: the EAGLE-3 head at {path} is for a target of hidden size "
                             f"{self.target_hidden_size} and vocabulary {self.vocab_size}, this model has "
                             f"{hidden_size} and {vocab_size}")
        if max(self.aux_layer_ids) >= num_layers:
            raise ValueError(f"--speculative-config: the EAGLE-3 head at {path} reads layer "
                             f"{max(self.aux_layer_ids)} (the final hidden state of {num_layers} layers), "
                             "which EPD does not serve")
