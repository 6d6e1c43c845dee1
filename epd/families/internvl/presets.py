"""`epd make-model` presets of InternVL (InternViT + a Qwen3 or Qwen3-MoE language
model) and the writer of their files, as a release lays them out.

The weights are transformers' random init through its own classes
(InternVLConfig with a Qwen3 or Qwen3-MoE text config); the final norm and the
MoE routers are scaled as Qwen's presets scale theirs (peaked logits, decisive
routing), and the tokenizer is epd/families/random_checkpoints.py's byte-level
BPE with Qwen's chat tokens and InternVL's image tokens (`<img>`, `</img>`, `<IMG_CONTEXT>`, `<video>`,
named in tokenizer_config.json as the processor reads them); the chat template
writes `<IMG_CONTEXT>` + newline per image as the released *-HF templates do.
Tiny presets use small tiles (64-pixel tiles of 8-pixel patches: 16 tokens a
tile) so tests run in seconds; the processor files say so
(preprocessor_config.json size, processor_config.json image_seq_length).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from epd.families.internvl.prompt_format import IMG_CONTEXT, IMG_END, IMG_START, VIDEO
from epd.families.random_checkpoints import LOGIT_STD, build_tokenizer, embed_chat_template, random_model

CHAT_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
IMAGE_TOKENS = {"start_image_token": IMG_START, "end_image_token": IMG_END,
                "context_image_token": IMG_CONTEXT, "video_token": VIDEO}
SPECIAL_TOKENS = CHAT_TOKENS + list(IMAGE_TOKENS.values())

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] }}"
    "{%- else %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] in ('image', 'image_url', 'image_pil') %}"
    "{{- '<IMG_CONTEXT>\\n' }}"
    "{%- elif part['type'] in ('video', 'video_url') %}"
    "{{- '<video>\\n' }}"
    "{%- elif part['type'] == 'text' %}"
    "{{- part['text'] }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)
IMAGE_MEAN, IMAGE_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]  # the releases' (ImageNet)
ROUTER_LOGIT_STD = 4.0  # MoE router logits' spread: top-k choices far apart


@dataclass(frozen=True)
class InternVLPreset:
    """One checkpoint's architecture: the Qwen3 (or Qwen3-MoE) text model and InternViT."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vision_layers: int
    vision_hidden: int
    vision_heads: int
    vision_intermediate: int
    tile_size: int = 448
    patch_size: int = 14
    max_patches: int = 12
    tokenizer_vocab: int = 1024
    dtype: str = "float32"
    tie_word_embeddings: bool = False
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 4096
    vision_feature_layer: int = -1
    use_mean_pooling: bool = True
    use_qk_norm: bool = False
    norm_type: str = "layer_norm"
    text_model_type: str = "qwen3"  # "qwen3" (InternVL3.5) or "qwen2" (InternVL3: q/k/v biases, no q/k norm)
    # Qwen3-MoE language model when num_experts > 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0

    @property
    def tokens_per_tile(self) -> int:
        return (self.tile_size // self.patch_size // 2) ** 2


PRESETS: dict[str, InternVLPreset] = {
    "internvl-tiny": InternVLPreset(
        hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
        vision_layers=2, vision_hidden=32, vision_heads=2, vision_intermediate=64,
        tile_size=64, patch_size=8, max_patches=6),
    "internvl-moe-tiny": InternVLPreset(
        hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
        vision_layers=2, vision_hidden=32, vision_heads=2, vision_intermediate=64,
        tile_size=64, patch_size=8, max_patches=6,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
    # For CPU benchmarks and vLLM's CPU build (head_dim 64: a size its attention takes): ~110M
    # parameters, the release's 448-pixel tiles of 256 tokens.
    "internvl-small": InternVLPreset(
        hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, head_dim=64, intermediate_size=2304,
        vision_layers=8, vision_hidden=512, vision_heads=8, vision_intermediate=1536,
        tokenizer_vocab=8192, max_position_embeddings=32768),
}


def internvl_tokenizer(vocab_size: int):
    """A byte-level BPE with the chat and image tokens, the processor's names for the image
    tokens (tokenizer.start_image_token, ...) and the chat template above."""
    return build_tokenizer(vocab_size, SPECIAL_TOKENS, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                           chat_template=CHAT_TEMPLATE, **IMAGE_TOKENS)


def hf_config(p: InternVLPreset, ids: dict[str, int], vocab_size: int):
    """transformers' InternVLConfig of the preset (Qwen3, Qwen3-MoE or Qwen2 text config)."""
    from transformers import InternVLConfig

    text = dict(
        model_type="qwen3_moe" if p.num_experts else p.text_model_type, vocab_size=vocab_size,
        hidden_size=p.hidden_size, intermediate_size=p.intermediate_size, num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads, num_key_value_heads=p.num_kv_heads,
        max_position_embeddings=p.max_position_embeddings, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=p.rope_theta),
        tie_word_embeddings=p.tie_word_embeddings,
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])
    if text["model_type"] != "qwen2":  # Qwen2's head_dim is hidden / heads
        text.update(head_dim=p.head_dim)
    if p.num_experts:
        text.update(num_experts=p.num_experts, num_experts_per_tok=p.num_experts_per_tok,
                    moe_intermediate_size=p.moe_intermediate_size, norm_topk_prob=True, decoder_sparse_step=1)
    vision = dict(
        hidden_size=p.vision_hidden, num_hidden_layers=p.vision_layers, num_attention_heads=p.vision_heads,
        intermediate_size=p.vision_intermediate, image_size=[p.tile_size] * 2, patch_size=[p.patch_size] * 2,
        use_mean_pooling=p.use_mean_pooling, use_qk_norm=p.use_qk_norm, norm_type=p.norm_type)
    return InternVLConfig(
        text_config=text, vision_config=vision, image_token_id=ids[IMG_CONTEXT],
        image_seq_length=p.tokens_per_tile, downsample_ratio=0.5, vision_feature_layer=p.vision_feature_layer,
        tie_word_embeddings=p.tie_word_embeddings)


def write_checkpoint(out: Path, p: InternVLPreset, seed: int) -> None:
    """The preset's random-weight checkpoint, tokenizer and processor files in `out`
    (epd/tools/make_model.py `make_model`)."""
    import torch
    from transformers import GenerationConfig, InternVLForConditionalGeneration

    tokenizer = internvl_tokenizer(p.tokenizer_vocab)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = hf_config(p, ids, len(tokenizer))
    model = random_model(lambda: InternVLForConditionalGeneration(config), p.dtype, seed)
    with torch.no_grad():
        lm = model.model.language_model
        init_std = model.lm_head.weight.float().std().item()
        lm.norm.weight.mul_(LOGIT_STD / (init_std * p.hidden_size ** 0.5))  # peaked logits
        for layer in lm.layers:
            router = getattr(layer.mlp, "gate", None)
            if isinstance(router, torch.nn.Module):  # decisive routing
                router.weight.mul_(ROUTER_LOGIT_STD / (router.weight.float().std().item() * p.hidden_size ** 0.5))
        for layer in model.model.vision_tower.encoder.layer:  # random layer scales: the init's 0.1 everywhere
            layer.lambda_1.uniform_(0.05, 0.5)
            layer.lambda_2.uniform_(0.05, 0.5)
        model.model.vision_tower.embeddings.cls_token.normal_(0.0, 0.02)
        model.model.vision_tower.embeddings.position_embeddings.normal_(0.0, 0.02)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=ids["<|endoftext|>"], eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
                     pad_token_id=ids["<|endoftext|>"], do_sample=False).save_pretrained(out)
    tokenizer.save_pretrained(out)
    embed_chat_template(out, CHAT_TEMPLATE)
    write_processor_configs(out, p)


def write_processor_configs(out: Path, p: InternVLPreset) -> None:
    """preprocessor_config.json (GotOcr2's image processor, as the releases: crop_to_patches false
    there, the processor crops), video_preprocessor_config.json (InternVLVideoProcessor: each
    frame resized to one tile, every frame unless sampling is asked for) and
    processor_config.json (tokens per tile)."""
    image = {
        "image_processor_type": "GotOcr2ImageProcessorFast", "processor_class": "InternVLProcessor",
        "crop_to_patches": False, "min_patches": 1, "max_patches": p.max_patches,
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "do_convert_rgb": True, "image_mean": IMAGE_MEAN, "image_std": IMAGE_STD, "resample": 3,
        "size": {"height": p.tile_size, "width": p.tile_size},
    }
    (out / "preprocessor_config.json").write_text(json.dumps(image, indent=2) + "\n")
    video = {
        "video_processor_type": "InternVLVideoProcessor", "processor_class": "InternVLProcessor",
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "do_convert_rgb": True, "image_mean": IMAGE_MEAN, "image_std": IMAGE_STD, "resample": 3,
        "size": {"height": p.tile_size, "width": p.tile_size}, "do_sample_frames": False, "initial_shift": True,
    }
    (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")
    processor = {"processor_class": "InternVLProcessor", "image_seq_length": p.tokens_per_tile}
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
