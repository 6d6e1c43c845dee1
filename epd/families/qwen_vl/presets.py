"""`epd make-model` presets of the Qwen families: Qwen3-VL, Qwen3-VL-MoE and Qwen2.5-VL (`Preset.family`).

Written with transformers' own config and model classes (random init); the
tokenizer carries Qwen's special tokens and the chat template follows
Qwen3-VL's (Qwen2.5-VL's is the same for text and images). MoE router weights
are scaled so routing is decisive (epd/tools/make_model.py scales the logits).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from epd.families.random_checkpoints import LOGIT_STD, build_tokenizer, embed_chat_template, random_model

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Qwen3-VL's chat template, reduced to text, images, videos and tools: string or list
# content, multi-turn, system messages, an assistant prompt at the end on
# request; with `tools`, Qwen's tools system block (the first system message
# merged into it), assistant `tool_calls` as <tool_call> blocks and `tool`
# messages as <tool_response> blocks in a user turn, as in the real template.
CHAT_TEMPLATE = (
    "{%- macro render_content(content) %}"
    "{%- if content is string %}"
    "{{- content }}"
    "{%- else %}"
    "{%- for part in content %}"
    "{%- if part['type'] in ('image', 'image_url', 'image_pil') or 'image' in part %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] in ('video', 'video_url') or 'video' in part %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}"
    "{{- part['text'] }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{%- endmacro %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- render_content(messages[0]['content']) + '\\n\\n' }}"
    "{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}"
    "{{- '\\n' }}{{- tool | tojson }}"
    "{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}"
    "{%- endif %}"
    "{{- '\\n<tool_response>\\n' + render_content(message['content']) + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- elif not (tools and loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{{- render_content(message['content']) }}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] %}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- if (loop.first and message['content']) or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{%- set call = tool_call['function'] if tool_call['function'] else tool_call %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{%- if call['arguments'] is string %}{{- call['arguments'] }}{%- else %}{{- call['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


@dataclass(frozen=True)
class Preset:
    """Architecture of one checkpoint preset (text decoder + vision tower)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    mrope_section: tuple[int, int, int]
    vocab_size: int | None  # None: exactly the tokenizer's size
    tie_word_embeddings: bool
    vision_depth: int
    vision_hidden: int
    vision_heads: int
    vision_intermediate: int
    num_position_embeddings: int
    deepstack_indexes: tuple[int, ...]
    min_pixels: int
    max_pixels: int
    tokenizer_vocab: int
    dtype: str  # dtype the weights are stored in
    rope_theta: float = 5_000_000.0
    max_position_embeddings: int = 262_144
    family: str = "qwen3_vl"  # model_type: qwen3_vl, qwen3_vl_moe or qwen2_5_vl
    # qwen3_vl_moe: sparse MLPs except in mlp_only_layers (those use intermediate_size)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    mlp_only_layers: tuple[int, ...] = ()
    # qwen2_5_vl: window attention except in the fullatt blocks (head_dim = hidden / heads)
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = ()
    patch_size: int = 16  # Qwen2.5-VL: 14


PRESETS: dict[str, Preset] = {
    # For tests: loads in well under a second.
    "tiny": Preset(
        hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, mrope_section=(4, 2, 2), vocab_size=None,
        tie_word_embeddings=False, vision_depth=3, vision_hidden=32, vision_heads=2,
        vision_intermediate=64, num_position_embeddings=64, deepstack_indexes=(0, 1),
        min_pixels=32 * 32, max_pixels=256 * 256, tokenizer_vocab=1024, dtype="float32",
        max_position_embeddings=4096,
    ),
    # For CPU benchmarks: ~150M parameters, ViT ~35M; a 448x448 image costs
    # about as much as a ~400-token prefill.
    "small": Preset(
        hidden_size=768, num_layers=14, num_heads=12, num_kv_heads=4, head_dim=64,
        intermediate_size=2304, mrope_section=(12, 10, 10), vocab_size=None,
        tie_word_embeddings=False, vision_depth=8, vision_hidden=512, vision_heads=8,
        vision_intermediate=1536, num_position_embeddings=1024, deepstack_indexes=(2, 5),
        min_pixels=32 * 32, max_pixels=512 * 512, tokenizer_vocab=8192, dtype="float32",
        max_position_embeddings=32768,
    ),
    # Published architecture shapes (Qwen3-VL-2B/4B-Instruct), for GPU runs.
    "qwen3-vl-2b": Preset(
        hidden_size=2048, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
        intermediate_size=6144, mrope_section=(24, 20, 20), vocab_size=151936,
        tie_word_embeddings=True, vision_depth=24, vision_hidden=1024, vision_heads=16,
        vision_intermediate=4096, num_position_embeddings=2304, deepstack_indexes=(5, 11, 17),
        min_pixels=65536, max_pixels=16777216, tokenizer_vocab=8192, dtype="bfloat16",
    ),
    "qwen3-vl-4b": Preset(
        hidden_size=2560, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
        intermediate_size=9728, mrope_section=(24, 20, 20), vocab_size=151936,
        tie_word_embeddings=True, vision_depth=24, vision_hidden=1024, vision_heads=16,
        vision_intermediate=4096, num_position_embeddings=2304, deepstack_indexes=(5, 11, 17),
        min_pixels=65536, max_pixels=16777216, tokenizer_vocab=8192, dtype="bfloat16",
    ),
    # Qwen3-VL-MoE: Qwen3-VL's tower with sparse MoE decoder layers.
    "qwen3-vl-moe-tiny": Preset(
        hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, mrope_section=(4, 2, 2), vocab_size=None,
        tie_word_embeddings=False, vision_depth=3, vision_hidden=32, vision_heads=2,
        vision_intermediate=64, num_position_embeddings=64, deepstack_indexes=(0, 1),
        min_pixels=32 * 32, max_pixels=256 * 256, tokenizer_vocab=1024, dtype="float32",
        max_position_embeddings=4096, family="qwen3_vl_moe",
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    ),
    # CPU benchmarks: ~250M parameters in all, ~70M active per token.
    "qwen3-vl-moe-small": Preset(
        hidden_size=512, num_layers=12, num_heads=8, num_kv_heads=4, head_dim=64,
        intermediate_size=1536, mrope_section=(12, 10, 10), vocab_size=None,
        tie_word_embeddings=False, vision_depth=8, vision_hidden=512, vision_heads=8,
        vision_intermediate=1536, num_position_embeddings=1024, deepstack_indexes=(2, 5),
        min_pixels=32 * 32, max_pixels=512 * 512, tokenizer_vocab=8192, dtype="float32",
        max_position_embeddings=32768, family="qwen3_vl_moe",
        num_experts=32, num_experts_per_tok=4, moe_intermediate_size=384,
    ),
    # Published shapes of Qwen3-VL-30B-A3B-Instruct (128 experts, 8 active), for GPU runs.
    "qwen3-vl-30b-a3b": Preset(
        hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
        intermediate_size=6144, mrope_section=(24, 20, 20), vocab_size=151936,
        tie_word_embeddings=False, vision_depth=27, vision_hidden=1152, vision_heads=16,
        vision_intermediate=4304, num_position_embeddings=2304, deepstack_indexes=(8, 16, 24),
        min_pixels=65536, max_pixels=16777216, tokenizer_vocab=8192, dtype="bfloat16",
        family="qwen3_vl_moe", num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
    ),
    # Qwen2.5-VL: windowed ViT with 14-pixel patches, Qwen2 decoder.
    "qwen2.5-vl-tiny": Preset(
        hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, mrope_section=(2, 3, 3), vocab_size=None,
        tie_word_embeddings=False, vision_depth=3, vision_hidden=32, vision_heads=2,
        vision_intermediate=64, num_position_embeddings=0, deepstack_indexes=(),
        min_pixels=28 * 28, max_pixels=224 * 224, tokenizer_vocab=1024, dtype="float32",
        rope_theta=1_000_000.0, max_position_embeddings=4096, family="qwen2_5_vl",
        window_size=56, fullatt_block_indexes=(1,), patch_size=14,
    ),
    "qwen2.5-vl-small": Preset(
        hidden_size=768, num_layers=14, num_heads=12, num_kv_heads=4, head_dim=64,
        intermediate_size=2304, mrope_section=(8, 12, 12), vocab_size=None,
        tie_word_embeddings=False, vision_depth=8, vision_hidden=512, vision_heads=8,
        vision_intermediate=1536, num_position_embeddings=0, deepstack_indexes=(),
        min_pixels=28 * 28, max_pixels=448 * 448, tokenizer_vocab=8192, dtype="float32",
        rope_theta=1_000_000.0, max_position_embeddings=32768, family="qwen2_5_vl",
        window_size=112, fullatt_block_indexes=(3, 7), patch_size=14,
    ),
    # Published shapes of Qwen2.5-VL-7B-Instruct, for GPU runs.
    "qwen2.5-vl-7b": Preset(
        hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
        intermediate_size=18944, mrope_section=(16, 24, 24), vocab_size=152064,
        tie_word_embeddings=False, vision_depth=32, vision_hidden=1280, vision_heads=16,
        vision_intermediate=3420, num_position_embeddings=0, deepstack_indexes=(),
        min_pixels=3136, max_pixels=12845056, tokenizer_vocab=8192, dtype="bfloat16",
        rope_theta=1_000_000.0, max_position_embeddings=128000, family="qwen2_5_vl",
        window_size=112, fullatt_block_indexes=(7, 15, 23, 31), patch_size=14,
    ),
}

# Image normalisation of each family's processor (Qwen2.5-VL keeps CLIP's).
IMAGE_MEAN_STD = {
    "qwen3_vl": ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5]),
    "qwen3_vl_moe": ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5]),
    "qwen2_5_vl": ([0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]),
}
PROCESSOR_CLASS = {"qwen3_vl": "Qwen3VLProcessor", "qwen3_vl_moe": "Qwen3VLProcessor",
                   "qwen2_5_vl": "Qwen2_5_VLProcessor"}
# Standard deviation of the MoE router logits: top-k choices far apart.
ROUTER_LOGIT_STD = 4.0

def qwen_tokenizer(vocab_size: int):
    """A byte-level BPE with Qwen's special tokens and the chat template above."""
    return build_tokenizer(vocab_size, SPECIAL_TOKENS, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                           chat_template=CHAT_TEMPLATE)


def qwen_tokenizer_ids(tokenizer_vocab: int, vocab_size: int | None):
    """(Qwen's tokenizer of `tokenizer_vocab` tokens, its special tokens' ids, the model's vocab size:
    `vocab_size`, else exactly the tokenizer's)."""
    tokenizer = qwen_tokenizer(tokenizer_vocab)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab_size = vocab_size or len(tokenizer)
    assert vocab_size >= len(tokenizer), "the model's vocab must cover the tokenizer"
    return tokenizer, ids, vocab_size


def write_qwen_text_files(out: Path, tokenizer, ids: dict[str, int]) -> None:
    """generation_config.json (greedy; Qwen's EOS and pad ids), the tokenizer and its chat template in `out`."""
    from transformers import GenerationConfig

    GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
        do_sample=False,
    ).save_pretrained(out)
    tokenizer.save_pretrained(out)
    embed_chat_template(out, CHAT_TEMPLATE)


def write_checkpoint(out: Path, p: Preset, seed: int) -> None:
    """The preset's random-weight checkpoint, tokenizer and processor files in `out`
    (epd/tools/make_model.py `make_model`)."""
    import torch

    if p.family not in PROCESSOR_CLASS:
        raise ValueError(f"unknown family {p.family!r}; choose one of {', '.join(PROCESSOR_CLASS)}")
    tokenizer, ids, vocab_size = qwen_tokenizer_ids(p.tokenizer_vocab, p.vocab_size)
    config_cls, model_cls, config = _hf_config(p, ids, vocab_size)

    model = random_model(lambda: model_cls(config_cls(**config)), p.dtype, seed)
    with torch.no_grad():
        # Peaked logits: logit std = norm_scale * init_std * sqrt(hidden).
        init_std = model.lm_head.weight.float().std().item()
        norm_scale = LOGIT_STD / (init_std * p.hidden_size ** 0.5)
        model.model.language_model.norm.weight.mul_(norm_scale)
        for layer in model.model.language_model.layers:
            router = getattr(layer.mlp, "gate", None)
            if isinstance(router, torch.nn.Module):  # decisive routing: router logit std ~ ROUTER_LOGIT_STD
                router.weight.mul_(ROUTER_LOGIT_STD / (router.weight.float().std().item() * p.hidden_size ** 0.5))
    model.save_pretrained(out, safe_serialization=True)
    write_qwen_text_files(out, tokenizer, ids)
    write_processor_configs(out, p)


def _hf_config(p: Preset, ids: dict[str, int], vocab_size: int):
    """(transformers config class, model class, config kwargs) for the preset's family."""
    import transformers

    text = dict(
        vocab_size=vocab_size, hidden_size=p.hidden_size, intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_layers, num_attention_heads=p.num_heads, num_key_value_heads=p.num_kv_heads,
        max_position_embeddings=p.max_position_embeddings, rms_norm_eps=1e-6,
        tie_word_embeddings=p.tie_word_embeddings,
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
    )
    vision = dict(depth=p.vision_depth, hidden_size=p.vision_hidden, intermediate_size=p.vision_intermediate,
                  num_heads=p.vision_heads, patch_size=p.patch_size, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=p.hidden_size)
    top = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
               vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
               tie_word_embeddings=p.tie_word_embeddings)
    if p.family == "qwen2_5_vl":
        text.update(rope_parameters=dict(rope_type="default", rope_theta=p.rope_theta,
                                         mrope_section=list(p.mrope_section)))
        vision.update(hidden_act="silu", window_size=p.window_size,
                      fullatt_block_indexes=list(p.fullatt_block_indexes))
        return (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration,
                dict(text_config=text, vision_config=vision, **top))
    text.update(head_dim=p.head_dim, rope_parameters=dict(rope_type="default", rope_theta=p.rope_theta,
                                                         mrope_section=list(p.mrope_section),
                                                         mrope_interleaved=True))
    vision.update(hidden_act="gelu_pytorch_tanh", num_position_embeddings=p.num_position_embeddings,
                  deepstack_visual_indexes=list(p.deepstack_indexes))
    if p.family == "qwen3_vl_moe":
        text.update(num_experts=p.num_experts, num_experts_per_tok=p.num_experts_per_tok,
                    moe_intermediate_size=p.moe_intermediate_size, mlp_only_layers=list(p.mlp_only_layers))
        return (transformers.Qwen3VLMoeConfig, transformers.Qwen3VLMoeForConditionalGeneration,
                dict(text_config=text, vision_config=vision, **top))
    return (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration,
            dict(text_config=text, vision_config=vision, **top))


def write_processor_configs(out: Path, p: Preset) -> None:
    """preprocessor_config.json and, as the family's releases, video_preprocessor_config.json."""
    mean, std = IMAGE_MEAN_STD[p.family]
    cfg = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": PROCESSOR_CLASS[p.family],
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": mean,
        "image_std": std,
        "resample": 3,
        "size": {"shortest_edge": p.min_pixels, "longest_edge": p.max_pixels},
        "patch_size": p.patch_size,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if p.family in VIDEO_SIZE:
        _write_video_config(out, p)


# Qwen3-VL releases ship video_preprocessor_config.json with these pixel bounds
# (a 4096-pixel floor, 25165824 pixels over all frames); Qwen2.5-VL's ship none,
# and transformers then reads preprocessor_config.json for video as well.
VIDEO_SIZE = {"qwen3_vl": {"longest_edge": 25165824, "shortest_edge": 4096},
              "qwen3_vl_moe": {"longest_edge": 25165824, "shortest_edge": 4096}}


def _write_video_config(out: Path, p: Preset) -> None:
    mean, std = IMAGE_MEAN_STD[p.family]
    cfg = {
        "size": VIDEO_SIZE[p.family],
        "patch_size": p.patch_size,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": mean,
        "image_std": std,
        "processor_class": PROCESSOR_CLASS[p.family],
        "video_processor_type": "Qwen3VLVideoProcessor",
    }
    (out / "video_preprocessor_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
