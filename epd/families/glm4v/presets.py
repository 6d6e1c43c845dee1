"""`epd make-model` presets of GLM-4.1V (`glm4v`) and GLM-4.5V (`glm4v_moe`), and the writer of their files.

A random-weight checkpoint in the release's layout: config.json through
transformers' Glm4vConfig / Glm4vMoeConfig (partial rotary and contiguous
M-RoPE sections in the text config's rope parameters, as transformers reads
the release's; `attention_bias` true, as the releases say), safetensors with
the release's tensor names (transformers' own model class saves them;
GLM-4.5V's experts one tensor each), GLM's special tokens (`[gMASK]<sop>`,
roles, `<|begin_of_image|> <|image|> <|end_of_image|>`, the video ones) on a
locally trained byte-level BPE, the release's chat template, and the image
and video processor files the release ships (Glm4vImageProcessor /
Glm4vVideoProcessor, CLIP's normalisation, 14-pixel patches), with small
pixel bounds for tests.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from epd.families.random_checkpoints import LOGIT_STD, build_tokenizer, embed_chat_template, random_model

SPECIAL_TOKENS = [
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
    "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>", "<|image|>", "<|video|>",
    "<think>", "</think>", "<|begin_of_box|>", "<|end_of_box|>",
]
# generation stops at the end of text or where the next turn (user, tool output) would begin
EOS_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")

# GLM-4.1V-9B-Thinking's chat_template.jinja, as released: one `<|begin_of_image|><|image|><|end_of_image|>`
# per image and `<|begin_of_video|><|video|><|end_of_video|>` per video, which the processor expands.
CHAT_TEMPLATE = """[gMASK]<sop>
{%- for msg in messages %}
    {%- if msg.role == 'system' %}
<|system|>
{{ msg.content }}
    {%- elif msg.role == 'user' %}
<|user|>{{ '\\n' }}

        {%- if msg.content is string %}
{{ msg.content }}
        {%- else %}
            {%- for item in msg.content %}
                {%- if item.type == 'video' or 'video' in item %}
<|begin_of_video|><|video|><|end_of_video|>
                {%- elif item.type == 'image' or 'image' in item %}
<|begin_of_image|><|image|><|end_of_image|>
                {%- elif item.type == 'text' %}
{{ item.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
    {%- elif msg.role == 'assistant' %}
        {%- if msg.metadata %}
<|assistant|>{{ msg.metadata }}
{{ msg.content }}
        {%- else %}
<|assistant|>
{{ msg.content }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{% if add_generation_prompt %}<|assistant|>
{% endif %}"""

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


@dataclass(frozen=True)
class Preset:
    """Architecture of one GLM-4.1V checkpoint preset (text decoder + vision tower)."""

    hidden_size: int
    num_layers: int
    num_heads: int  # head_dim = hidden_size / num_heads (glm4v)
    num_kv_heads: int
    intermediate_size: int
    mrope_section: tuple[int, int, int]  # sums to head_dim x partial_rotary_factor / 2
    vision_depth: int
    vision_hidden: int
    vision_heads: int
    vision_intermediate: int
    min_pixels: int
    max_pixels: int
    vocab_size: int | None = None  # None: exactly the tokenizer's size
    partial_rotary_factor: float = 0.5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    vision_image_size: int = 112  # the tower's position-embedding grid is (image_size / patch_size)^2
    patch_size: int = 14
    tokenizer_vocab: int = 1024
    dtype: str = "float32"
    family: str = "glm4v"  # model_type: glm4v or glm4v_moe
    # glm4v_moe: head_dim (None: hidden / heads), routed MoE layers after the first `first_k_dense_replace`
    head_dim: int | None = None
    first_k_dense_replace: int = 1
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 1
    num_expert_groups: int = 1
    topk_expert_groups: int = 1
    routed_scaling_factor: float = 1.0


PRESETS: dict[str, Preset] = {
    # For tests: loads in well under a second; head_dim 32, 16 rotary dims.
    "glm4v-tiny": Preset(
        hidden_size=64, num_layers=3, num_heads=2, num_kv_heads=1, intermediate_size=128, mrope_section=(2, 3, 3),
        vision_depth=2, vision_hidden=32, vision_heads=2, vision_intermediate=64,
        min_pixels=28 * 28, max_pixels=224 * 224,
    ),
    # For CPU benchmarks and the vLLM check (like gemma3-small / internvl-small): head_dim 64 (32 rotary dims,
    # GLM-4.1V-9B's sections halved), 448x448 images of 256 tokens, the 9B's 336-pixel position grid.
    "glm4v-small": Preset(
        hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, intermediate_size=2304, mrope_section=(4, 6, 6),
        vision_depth=8, vision_hidden=512, vision_heads=8, vision_intermediate=1536, vision_image_size=336,
        min_pixels=112 * 112, max_pixels=448 * 448, tokenizer_vocab=8192, max_position_embeddings=32768,
    ),
    # GLM-4.5V's shape: one dense layer, then MoE layers of 8 experts in 2 groups, 2 active, one shared.
    "glm4v-moe-tiny": Preset(
        hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=128,
        mrope_section=(2, 3, 3), vision_depth=2, vision_hidden=32, vision_heads=2, vision_intermediate=64,
        min_pixels=28 * 28, max_pixels=224 * 224, family="glm4v_moe", num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, num_expert_groups=2, topk_expert_groups=1, routed_scaling_factor=1.5,
    ),
}
# transformers' (config, model) classes of each family
CLASSES = {"glm4v": ("Glm4vConfig", "Glm4vForConditionalGeneration"),
           "glm4v_moe": ("Glm4vMoeConfig", "Glm4vMoeForConditionalGeneration")}
# Standard deviation of the MoE router logits: expert choices far apart.
ROUTER_LOGIT_STD = 4.0


def write_checkpoint(out: Path, p: Preset, seed: int) -> None:
    """Writes preset `p`'s random-weight checkpoint into the directory `out` (epd/tools/make_model.py)."""
    import torch
    import transformers

    tokenizer = build_tokenizer(p.tokenizer_vocab, SPECIAL_TOKENS, eos_token="<|endoftext|>",
                                pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab_size = p.vocab_size or len(tokenizer)
    assert vocab_size >= len(tokenizer), "the model's vocab must cover the tokenizer"
    config_cls, model_cls = (getattr(transformers, name) for name in CLASSES[p.family])
    config = config_cls(**_config(p, ids, vocab_size))

    model = random_model(lambda: model_cls(config), p.dtype, seed)
    with torch.no_grad():
        # transformers inits biases to 0 and norms to 1: drawn here, so a misplaced one changes the logits
        for name, param in model.model.language_model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.05)
            elif name.endswith("layernorm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):  # decisive routing: router logit std ~ ROUTER_LOGIT_STD
                param.mul_(ROUTER_LOGIT_STD / (param.float().std().item() * p.hidden_size ** 0.5))
        for name, buffer in model.model.language_model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # 0 at init: drawn, so a misplaced one changes the choice
                buffer.normal_(0.0, 0.1)
        # peaked logits: logit std = norm_scale * init_std * sqrt(hidden)
        init_std = model.lm_head.weight.float().std().item()
        model.model.language_model.norm.weight.mul_(LOGIT_STD / (init_std * p.hidden_size ** 0.5))
    model.save_pretrained(out, safe_serialization=True)
    transformers.GenerationConfig(
        eos_token_id=[ids[t] for t in EOS_TOKENS], pad_token_id=ids["<|endoftext|>"], do_sample=False,
    ).save_pretrained(out)
    tokenizer.save_pretrained(out)
    embed_chat_template(out, CHAT_TEMPLATE)
    write_processor_configs(out, p)


def _config(p: Preset, ids: dict[str, int], vocab_size: int) -> dict:
    """The config class's arguments for the preset: the release's keys, the preset's shapes."""
    text = dict(
        vocab_size=vocab_size, hidden_size=p.hidden_size, intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_layers, num_attention_heads=p.num_heads, num_key_value_heads=p.num_kv_heads,
        max_position_embeddings=p.max_position_embeddings, rms_norm_eps=1e-5, pad_token_id=ids["<|endoftext|>"],
        # q/k/v biases, as the releases' config.json says: transformers' GLM-4.1V has them whatever the key
        # says; vLLM's reads them only where it says so (without it, it drops them and serves other text)
        attention_bias=True,
        rope_parameters=dict(rope_type="default", rope_theta=p.rope_theta,
                             partial_rotary_factor=p.partial_rotary_factor, mrope_section=list(p.mrope_section)),
    )
    if p.family == "glm4v_moe":
        text.update(head_dim=p.head_dim or p.hidden_size // p.num_heads,
                    first_k_dense_replace=p.first_k_dense_replace, n_routed_experts=p.num_experts,
                    num_experts_per_tok=p.num_experts_per_tok, moe_intermediate_size=p.moe_intermediate_size,
                    n_shared_experts=p.num_shared_experts, n_group=p.num_expert_groups,
                    topk_group=p.topk_expert_groups, routed_scaling_factor=p.routed_scaling_factor,
                    norm_topk_prob=True)
    vision = dict(depth=p.vision_depth, hidden_size=p.vision_hidden, intermediate_size=p.vision_intermediate,
                  num_heads=p.vision_heads, patch_size=p.patch_size, image_size=p.vision_image_size,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=p.hidden_size, rms_norm_eps=1e-5)
    return dict(text_config=text, vision_config=vision, tie_word_embeddings=p.tie_word_embeddings,
                image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"],
                image_start_token_id=ids["<|begin_of_image|>"], image_end_token_id=ids["<|end_of_image|>"],
                video_start_token_id=ids["<|begin_of_video|>"], video_end_token_id=ids["<|end_of_video|>"])


def write_processor_configs(out: Path, p: Preset) -> None:
    """preprocessor_config.json and video_preprocessor_config.json with the release's keys."""
    common = {"do_rescale": True, "patch_size": p.patch_size, "temporal_patch_size": 2, "merge_size": 2,
              "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "processor_class": "Glm4vProcessor"}
    image = {"size": {"shortest_edge": p.min_pixels, "longest_edge": p.max_pixels}, **common,
             "image_processor_type": "Glm4vImageProcessor"}
    # the release bounds a video's pixels over all its frames: 2 x 30000 frames' worth of 28-pixel cells
    video = {"size": {"shortest_edge": p.min_pixels, "longest_edge": 28 * 28 * 2 * 30000}, **common,
             "video_processor_type": "Glm4vVideoProcessor"}
    (out / "preprocessor_config.json").write_text(json.dumps(image, indent=2) + "\n")
    (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")
