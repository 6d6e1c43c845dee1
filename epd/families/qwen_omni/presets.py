"""`epd make-model` presets of Qwen2.5-Omni: the thinker (text, vision and audio towers), no talker.

Written with transformers' own classes (Qwen2_5OmniConfig with
`enable_audio_output=False`, Qwen2_5OmniForConditionalGeneration: random
init, `thinker.*` tensors as the releases name them) and saved with
Qwen2_5OmniProcessor (Qwen2-VL's image processor, Whisper's feature
extractor at 16 kHz, a tokenizer carrying Omni's special tokens and a chat
template reduced from the release's).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from epd.families.random_checkpoints import LOGIT_STD, build_tokenizer, embed_chat_template, random_model

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>",
                  "<|vision_bos|>", "<|vision_eos|>", "<|IMAGE|>", "<|VIDEO|>"]
NAMED_TOKENS = dict(image_token="<|IMAGE|>", video_token="<|VIDEO|>", audio_token="<|AUDIO|>",
                    vision_bos_token="<|vision_bos|>", vision_eos_token="<|vision_eos|>",
                    audio_bos_token="<|audio_bos|>", audio_eos_token="<|audio_eos|>")

# The release's template reduced: its default system prompt, text, images, audio (any of its part types).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] }}"
    "{%- else %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] in ('image', 'image_url') or 'image' in part %}"
    "{{- '<|vision_bos|><|IMAGE|><|vision_eos|>' }}"
    "{%- elif part['type'] in ('audio', 'audio_url', 'input_audio') or 'audio' in part %}"
    "{{- '<|audio_bos|><|AUDIO|><|audio_eos|>' }}"
    "{%- elif part['type'] in ('video', 'video_url') or 'video' in part %}"
    "{{- '<|vision_bos|><|VIDEO|><|vision_eos|>' }}"
    "{%- elif 'text' in part %}"
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


@dataclass(frozen=True)
class Preset:
    """The thinker's shapes: Qwen2 decoder with M-RoPE, Qwen2.5-VL's windowed tower, the audio tower."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    mrope_section: tuple[int, int, int]
    vision_depth: int
    vision_hidden: int
    vision_heads: int
    vision_intermediate: int
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    audio_layers: int
    audio_d_model: int
    audio_heads: int
    audio_ffn: int
    n_window: int  # half an audio window, in log-mel frames (the release: 100)
    min_pixels: int
    max_pixels: int
    tokenizer_vocab: int
    vocab_size: int | None = None  # None: exactly the tokenizer's size
    tie_word_embeddings: bool = False
    dtype: str = "float32"
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 4096
    num_mel_bins: int = 128


PRESETS: dict[str, Preset] = {
    # For tests: loads in well under a second. Windows of 2 x 10 frames (0.2 s) so short clips span several.
    "qwen2.5-omni-tiny": Preset(
        hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=128, mrope_section=(2, 3, 3),
        vision_depth=3, vision_hidden=32, vision_heads=2, vision_intermediate=64, window_size=56,
        fullatt_block_indexes=(1,), audio_layers=2, audio_d_model=32, audio_heads=2, audio_ffn=64, n_window=10,
        min_pixels=28 * 28, max_pixels=224 * 224, tokenizer_vocab=1024),
    # Published shapes of Qwen2.5-Omni-7B's thinker, for GPU runs.
    "qwen2.5-omni-7b": Preset(
        hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4, intermediate_size=18944,
        mrope_section=(16, 24, 24), vision_depth=32, vision_hidden=1280, vision_heads=16, vision_intermediate=3420,
        window_size=112, fullatt_block_indexes=(7, 15, 23, 31), audio_layers=32, audio_d_model=1280,
        audio_heads=20, audio_ffn=5120, n_window=100, min_pixels=3136, max_pixels=12845056, tokenizer_vocab=8192,
        vocab_size=152064, dtype="bfloat16", max_position_embeddings=32768),
}


def omni_tokenizer(vocab_size: int):
    return build_tokenizer(vocab_size, SPECIAL_TOKENS, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                           chat_template=CHAT_TEMPLATE, **NAMED_TOKENS)


def write_checkpoint(out: Path, p: Preset, seed: int) -> None:
    """The preset's random-weight checkpoint, tokenizer and processor files in `out`."""
    import torch
    import transformers

    tokenizer = omni_tokenizer(p.tokenizer_vocab)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab_size = p.vocab_size or len(tokenizer)
    thinker = dict(
        text_config=dict(vocab_size=vocab_size, hidden_size=p.hidden_size, intermediate_size=p.intermediate_size,
                         num_hidden_layers=p.num_layers, num_attention_heads=p.num_heads,
                         num_key_value_heads=p.num_kv_heads, max_position_embeddings=p.max_position_embeddings,
                         rms_norm_eps=1e-6, tie_word_embeddings=p.tie_word_embeddings,
                         bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                         rope_parameters=dict(rope_type="default", rope_theta=p.rope_theta,
                                              mrope_section=list(p.mrope_section))),
        vision_config=dict(depth=p.vision_depth, hidden_size=p.vision_hidden, intermediate_size=p.vision_intermediate,
                           num_heads=p.vision_heads, out_hidden_size=p.hidden_size, window_size=p.window_size,
                           fullatt_block_indexes=list(p.fullatt_block_indexes), patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2),
        audio_config=dict(num_mel_bins=p.num_mel_bins, encoder_layers=p.audio_layers,
                          encoder_attention_heads=p.audio_heads, encoder_ffn_dim=p.audio_ffn, d_model=p.audio_d_model,
                          output_dim=p.hidden_size, n_window=p.n_window, max_source_positions=1500),
        audio_token_index=ids["<|AUDIO|>"], image_token_index=ids["<|IMAGE|>"], video_token_index=ids["<|VIDEO|>"],
        audio_start_token_id=ids["<|audio_bos|>"], audio_end_token_id=ids["<|audio_eos|>"],
        vision_start_token_id=ids["<|vision_bos|>"], vision_end_token_id=ids["<|vision_eos|>"],
        tie_word_embeddings=p.tie_word_embeddings,
    )
    config = transformers.Qwen2_5OmniConfig(thinker_config=thinker, enable_audio_output=False)
    model = random_model(lambda: transformers.Qwen2_5OmniForConditionalGeneration(config), p.dtype, seed)
    with torch.no_grad():  # peaked logits: logit std = norm_scale * init_std * sqrt(hidden)
        lm = model.thinker
        init_std = lm.lm_head.weight.float().std().item()
        lm.model.language_model.norm.weight.mul_(LOGIT_STD / (init_std * p.hidden_size ** 0.5))
    model.save_pretrained(out, safe_serialization=True)
    transformers.GenerationConfig(bos_token_id=ids["<|endoftext|>"],
                                  eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
                                  pad_token_id=ids["<|endoftext|>"], do_sample=False).save_pretrained(out)
    _write_processor(out, p, tokenizer)


def _write_processor(out: Path, p: Preset, tokenizer) -> None:
    """Qwen2_5OmniProcessor's files as the release has them: one preprocessor_config.json holding
    Qwen2-VL's image processor and Whisper's feature extractor, the tokenizer and its template.
    (Written by hand: transformers builds the processor's video part only with torchvision.)"""
    import transformers

    image = transformers.Qwen2VLImageProcessor(
        size={"shortest_edge": p.min_pixels, "longest_edge": p.max_pixels}, patch_size=14, temporal_patch_size=2,
        merge_size=2, image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711])
    audio = transformers.WhisperFeatureExtractor(feature_size=p.num_mel_bins, sampling_rate=16000, hop_length=160,
                                                 chunk_length=30, n_fft=400)
    cfg = {**audio.to_dict(), **image.to_dict(), "processor_class": "Qwen2_5OmniProcessor"}
    cfg.pop("mel_filters", None)  # computed from the sizes on load
    (out / "preprocessor_config.json").write_text(json.dumps(cfg, indent=2, default=str) + "\n")
    tokenizer.save_pretrained(out)
    embed_chat_template(out, CHAT_TEMPLATE)
