"""`epd make-model DIR --preset tiny-eagle3`: a random EAGLE-3 head, in Speculators' format,
for one of make_model's target presets (its hidden size, vocabulary, layer count, RoPE).

Nothing can be downloaded here, so the speculative-decoding tests draft with
a head made locally: config.json as Speculators writes it (engine/spec/eagle3.py
`config_dict`), model.safetensors with the published tensor names, a reduced
draft vocabulary (a seeded subset of the target's ids, through d2t / t2d) and
no embed_tokens (the head shares the target's, as most published heads do).
As in make_model, the final norm is scaled so the draft's logits are peaked:
its argmax, hence its drafts, must not hinge on float rounding.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from epd.families.qwen_vl.presets import PRESETS, qwen_tokenizer
from epd.families.random_checkpoints import LOGIT_STD


@dataclass(frozen=True)
class Eagle3Preset:
    target: str  # a make_model preset: the head matches its shapes
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    num_speculative_tokens: int
    norm_before_residual: bool = True


TARGET_ARCHITECTURES = {"qwen3_vl": "Qwen3VLForConditionalGeneration",
                        "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
                        "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}

EAGLE3_PRESETS: dict[str, Eagle3Preset] = {
    # For tests: the `tiny` target has 3 layers, so Speculators' default ids
    # [2, L // 2, L - 3] are {0, 1, 2}: the embeddings and the inputs of layers 1 and 2.
    "tiny-eagle3": Eagle3Preset(target="tiny", num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                                intermediate_size=128, draft_vocab_size=512, aux_layer_ids=(0, 1, 2),
                                num_speculative_tokens=3),
}


def make_eagle3(out_dir: str | Path, preset: str = "tiny-eagle3", seed: int = 0) -> Path:
    """Writes config.json + model.safetensors for a random head; returns the directory."""
    import torch
    from safetensors.torch import save_file

    from epd.engine.spec.eagle3 import Eagle3Config, Eagle3Head, config_dict

    if preset not in EAGLE3_PRESETS:
        raise ValueError(f"unknown EAGLE-3 preset {preset!r}; choose one of {', '.join(EAGLE3_PRESETS)}")
    e = EAGLE3_PRESETS[preset]
    target = PRESETS[e.target]
    vocab_size = target.vocab_size or len(qwen_tokenizer(target.tokenizer_vocab))
    cfg = Eagle3Config(
        hidden_size=target.hidden_size, target_hidden_size=target.hidden_size,
        intermediate_size=e.intermediate_size, num_layers=e.num_layers, num_heads=e.num_heads,
        num_kv_heads=e.num_kv_heads, head_dim=e.head_dim, rms_norm_eps=1e-6, rope_theta=target.rope_theta,
        vocab_size=vocab_size, draft_vocab_size=e.draft_vocab_size, aux_layer_ids=e.aux_layer_ids,
        num_speculative_tokens=e.num_speculative_tokens, norm_before_residual=e.norm_before_residual,
    )
    torch.manual_seed(seed)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        init_std = head.lm_head.weight.std().item()
        head.norm.weight.mul_(LOGIT_STD / (init_std * cfg.hidden_size ** 0.5))
        draft_ids = torch.randperm(vocab_size)[:cfg.draft_vocab_size].sort().values  # target ids, ascending
        head.d2t.copy_(draft_ids - torch.arange(cfg.draft_vocab_size))
        head.t2d.zero_()
        head.t2d[draft_ids] = True
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = config_dict(cfg, [TARGET_ARCHITECTURES[target.family]])
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
