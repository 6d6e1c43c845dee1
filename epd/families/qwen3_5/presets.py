"""`epd make-model` presets of Qwen3.5 (`qwen3_5`) and Qwen3.5-MoE (`qwen3_5_moe`), and their writer.

A random-weight checkpoint in the release's layout: config.json through transformers'
Qwen3_5Config / Qwen3_5MoeConfig (layer_types, partial rotary and interleaved M-RoPE in the
text config's rope parameters; the release's attn_output_gate, full_attention_interval,
mamba_ssm_dtype, mlp_only_layers and deepstack_visual_indexes keys, which vLLM reads), safetensors written by transformers' own model class
(`model.language_model.*`, `model.visual.*`, and the release's `mtp.*` MTP layers, random:
`write_mtp_layers`), Qwen's special tokens (those of qwen_vl/presets.py), the release's chat
template with its thinking switch (chat_template.py) and Qwen3-VL's image and video processor
files. The (1 + w) norms are random, not
the release's zeros, so a loader reading them as plain norms fails its tests; each linear
layer's decay A is drawn in (0.05, 1) so its state lasts over many tokens; the final norm is
scaled for peaked logits (epd/families/random_checkpoints.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from epd.families.qwen3_5.chat_template import CHAT_TEMPLATE
from epd.families.qwen_vl.presets import (PRESETS as QWEN_VL_PRESETS, ROUTER_LOGIT_STD, qwen_tokenizer_ids,
                                          write_processor_configs, write_qwen_text_files)
from epd.families.random_checkpoints import LOGIT_STD, embed_chat_template, random_model


@dataclass(frozen=True)
class Preset:
    """Architecture of one Qwen3.5 checkpoint preset (hybrid text decoder + Qwen3-VL-style tower)."""

    hidden_size: int
    num_layers: int
    full_attention_interval: int  # every n-th layer is full attention, the others Gated DeltaNet
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    linear_num_k_heads: int
    linear_num_v_heads: int
    linear_k_dim: int
    linear_v_dim: int
    mrope_section: tuple[int, int, int]  # sums to head_dim / 8 (a quarter of each head rotates)
    vocab_size: int | None  # None: exactly the tokenizer's size
    tie_word_embeddings: bool
    vision_depth: int
    vision_hidden: int
    vision_heads: int
    vision_intermediate: int
    num_position_embeddings: int
    min_pixels: int
    max_pixels: int
    tokenizer_vocab: int
    dtype: str  # dtype the weights are stored in
    linear_conv_kernel: int = 4
    rope_theta: float = 10_000_000.0
    max_position_embeddings: int = 262_144
    family: str = "qwen3_5"  # model_type: qwen3_5 or qwen3_5_moe
    # qwen3_5_moe: every layer's MLP is routed experts plus a shared expert
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    patch_size: int = 16


_TINY = Preset(
    hidden_size=64, num_layers=4, full_attention_interval=4, num_heads=4, num_kv_heads=2, head_dim=32,
    intermediate_size=128, linear_num_k_heads=2, linear_num_v_heads=4, linear_k_dim=16, linear_v_dim=16,
    mrope_section=(2, 1, 1), vocab_size=None, tie_word_embeddings=False, vision_depth=2, vision_hidden=32,
    vision_heads=2, vision_intermediate=64, num_position_embeddings=64, min_pixels=32 * 32,
    max_pixels=256 * 256, tokenizer_vocab=1024, dtype="float32", max_position_embeddings=4096,
)
_SMALL = Preset(
    hidden_size=768, num_layers=12, full_attention_interval=4, num_heads=8, num_kv_heads=2, head_dim=128,
    intermediate_size=2304, linear_num_k_heads=6, linear_num_v_heads=12, linear_k_dim=64, linear_v_dim=64,
    mrope_section=(6, 5, 5), vocab_size=None, tie_word_embeddings=False, vision_depth=8, vision_hidden=512,
    vision_heads=8, vision_intermediate=1536, num_position_embeddings=2304, min_pixels=64 * 64,
    max_pixels=512 * 512, tokenizer_vocab=8192, dtype="float32", max_position_embeddings=32768,
)

# The releases' shapes (config.json of Qwen3.5-27B and Qwen3.5-35B-A3B; Qwen3.6-35B-A3B is the latter's
# topology), for runs on a lent GPU: bfloat16 random weights (27B: ~54 GB, 35B-A3B: ~70 GB written), the
# release's vocab and image bounds, Qwen3.5's vision tower (27 blocks of 1152, 16-pixel patches).
_27B = Preset(
    hidden_size=5120, num_layers=64, full_attention_interval=4, num_heads=24, num_kv_heads=4, head_dim=256,
    intermediate_size=17408, linear_num_k_heads=16, linear_num_v_heads=48, linear_k_dim=128, linear_v_dim=128,
    mrope_section=(11, 11, 10), vocab_size=248320, tie_word_embeddings=False, vision_depth=27, vision_hidden=1152,
    vision_heads=16, vision_intermediate=4304, num_position_embeddings=2304, min_pixels=65536,
    max_pixels=16777216, tokenizer_vocab=8192, dtype="bfloat16",
)
_35B_A3B = dataclasses.replace(
    _27B, hidden_size=2048, num_layers=40, num_heads=16, num_kv_heads=2, intermediate_size=0,
    linear_num_v_heads=32, family="qwen3_5_moe", num_experts=256, num_experts_per_tok=8,
    moe_intermediate_size=512, shared_expert_intermediate_size=512,
)

PRESETS: dict[str, Preset] = {
    # For tests: three Gated DeltaNet layers then one full-attention layer; loads in well under a second.
    "qwen3.5-tiny": _TINY,
    # The same with every MLP routed over 8 experts (2 active) plus a shared expert.
    "qwen3.5-moe-tiny": dataclasses.replace(_TINY, family="qwen3_5_moe", num_experts=8, num_experts_per_tok=2,
                                            moe_intermediate_size=32, shared_expert_intermediate_size=48),
    # For CPU benchmarks and the vLLM check (like glm4v-small): nine Gated DeltaNet and three full-attention
    # layers, head_dim 128 (32 rotary dims, Qwen3.5's sections scaled), the release's 16-pixel patches
    # (a 448x448 image is 196 tokens, 512x512 256) and 48x48 position grid.
    "qwen3.5-small": _SMALL,
    # The same with every MLP routed over 16 experts (4 active) plus a shared expert.
    "qwen3.5-moe-small": dataclasses.replace(_SMALL, family="qwen3_5_moe", num_experts=16, num_experts_per_tok=4,
                                             moe_intermediate_size=384, shared_expert_intermediate_size=768),
    # The releases' shapes (lent GPU only): 64 layers of 5120; 40 of 2048 over 256 experts (8 active).
    "qwen3.5-27b": _27B,
    "qwen3.5-35b-a3b": _35B_A3B,
    "qwen3.6-35b-a3b": _35B_A3B,
}


def write_checkpoint(out: Path, p: Preset, seed: int) -> None:
    """The preset's random-weight checkpoint, tokenizer and processor files in `out`
    (epd/tools/make_model.py `make_model`)."""
    import torch

    tokenizer, ids, vocab_size = qwen_tokenizer_ids(p.tokenizer_vocab, p.vocab_size)
    config_cls, model_cls, config = _hf_config(p, ids, vocab_size)

    model = random_model(lambda: model_cls(config_cls(**config)), p.dtype, seed)
    with torch.no_grad():
        _randomize(model, p)
    model.save_pretrained(out, safe_serialization=True)
    write_mtp_layers(out, seed)
    write_qwen_text_files(out, tokenizer, ids)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)  # the release's, where transformers 5 saves it
    embed_chat_template(out, CHAT_TEMPLATE)
    write_processor_configs(out, dataclasses.replace(QWEN_VL_PRESETS["tiny"], min_pixels=p.min_pixels,
                                                     max_pixels=p.max_pixels, patch_size=p.patch_size))


def write_mtp_layers(out: Path, seed: int, agree: bool = False) -> None:
    """The release's MTP layers added to the checkpoint at `out` (`mtp.*` in model.safetensors,
    the text config's `mtp_num_hidden_layers`: 1): random, one full-attention layer of the
    target's kind made by transformers' class. With `agree`, MTP layers that predict what the
    target predicts, made so by turning the target into a bigram model: every layer's output
    projection (o_proj, out_proj, down_proj) zeroed, so its logits depend on the last token only,
    and the MTP layers pass the next token's normed embedding to the target's final norm and head.
    Every layer still runs its full cost: for measuring MTP's acceptance and speed-up (dense only:
    a MoE's routed experts would still mix in)."""
    import json

    import torch
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer

    text = transformers.AutoConfig.from_pretrained(out).text_config
    is_moe = getattr(text, "num_experts", 0) > 0
    assert not (agree and is_moe), "agreeing MTP layers are made for a dense checkpoint"
    layer_cls = Qwen3_5MoeDecoderLayer if is_moe else Qwen3_5DecoderLayer
    path = out / "model.safetensors"
    weights = load_file(path)
    final_norm = weights["model.language_model.norm.weight"]
    dtype, hidden = final_norm.dtype, text.hidden_size
    layer_config = type(text)(**{**text.to_dict(), "num_hidden_layers": 1, "layer_types": ["full_attention"]})
    torch.manual_seed(seed + 1)
    layer = layer_cls(layer_config, 0)
    tensors = {f"mtp.layers.0.{name}": t.detach().clone() for name, t in layer.state_dict().items()}
    for t in tensors.values():  # a bare layer's experts are uninitialised (a model's init fills them)
        t.normal_(0.0, 0.02 if t.ndim > 1 else 0.1)
    tensors["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden) * hidden ** -0.5
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{name}.weight"] = torch.randn(hidden) * 0.1
    if agree:
        for name, t in weights.items():
            if name.endswith(("self_attn.o_proj.weight", "linear_attn.out_proj.weight", "mlp.down_proj.weight")):
                t.zero_()
        tensors["mtp.fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
        tensors["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(hidden)  # (1 + w): a plain RMS norm
        tensors["mtp.norm.weight"] = final_norm.clone()
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            tensors[f"mtp.layers.0.{name}"].zero_()
    weights.update({name: t.to(dtype).contiguous() for name, t in tensors.items()})
    save_file(weights, path, metadata={"format": "pt"})
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 1
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def _randomize(model, p: Preset) -> None:
    """Random (1 + w) norms and gated norms, slow decays, decisive routing, peaked logits."""
    import torch

    lm = model.model.language_model
    for name, param in lm.named_parameters():
        if name.endswith("norm.weight") and name != "norm.weight":
            param.normal_(0.0, 0.1)
            if ".linear_attn.norm." in name:
                param.add_(1.0)  # the gated norm is a plain one (x * w)
        elif name.endswith("A_log"):
            param.copy_(torch.empty_like(param).uniform_(0.05, 1.0).log())
        elif name.endswith("dt_bias"):
            param.normal_(0.0, 0.5)
    for layer in lm.layers:
        router = getattr(layer.mlp, "gate", None)
        if isinstance(router, torch.nn.Module):  # router logit std ~ ROUTER_LOGIT_STD
            router.weight.mul_(ROUTER_LOGIT_STD / (router.weight.float().std().item() * p.hidden_size ** 0.5))
    init_std = model.lm_head.weight.float().std().item()
    lm.norm.weight.fill_(LOGIT_STD / (init_std * p.hidden_size ** 0.5) - 1.0)  # (1 + w) x the logit scale


def _hf_config(p: Preset, ids: dict[str, int], vocab_size: int):
    """(transformers config class, model class, config kwargs) for the preset's family."""
    import transformers

    layer_types = ["full_attention" if (i + 1) % p.full_attention_interval == 0 else "linear_attention"
                   for i in range(p.num_layers)]
    text = dict(
        vocab_size=vocab_size, hidden_size=p.hidden_size, num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads, num_key_value_heads=p.num_kv_heads, head_dim=p.head_dim,
        linear_num_key_heads=p.linear_num_k_heads, linear_num_value_heads=p.linear_num_v_heads,
        linear_key_head_dim=p.linear_k_dim, linear_value_head_dim=p.linear_v_dim,
        linear_conv_kernel_dim=p.linear_conv_kernel, layer_types=layer_types,
        max_position_embeddings=p.max_position_embeddings, rms_norm_eps=1e-6,
        tie_word_embeddings=p.tie_word_embeddings, bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        # keys the releases write and vLLM reads (gated attention output, the SSM state's dtype)
        attn_output_gate=True, full_attention_interval=p.full_attention_interval, mamba_ssm_dtype="float32",
        rope_parameters=dict(rope_type="default", rope_theta=p.rope_theta, partial_rotary_factor=0.25,
                             mrope_section=list(p.mrope_section), mrope_interleaved=True),
    )
    vision = dict(depth=p.vision_depth, hidden_size=p.vision_hidden, intermediate_size=p.vision_intermediate,
                  num_heads=p.vision_heads, patch_size=p.patch_size, spatial_merge_size=2, temporal_patch_size=2,
                  out_hidden_size=p.hidden_size, num_position_embeddings=p.num_position_embeddings,
                  deepstack_visual_indexes=[])  # as the releases say: Qwen3.5 has no deepstack
    top = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
               vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
               tie_word_embeddings=p.tie_word_embeddings)
    if p.family == "qwen3_5_moe":
        text.update(num_experts=p.num_experts, num_experts_per_tok=p.num_experts_per_tok,
                    moe_intermediate_size=p.moe_intermediate_size,
                    shared_expert_intermediate_size=p.shared_expert_intermediate_size, mlp_only_layers=[])
        return (transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration,
                dict(text_config=text, vision_config=vision, **top))
    if p.family != "qwen3_5":
        raise ValueError(f"unknown family {p.family!r}; choose qwen3_5 or qwen3_5_moe")
    text.update(intermediate_size=p.intermediate_size)
    return (transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration,
            dict(text_config=text, vision_config=vision, **top))
