"""Gemma 3 `epd make-model` presets and the writer of their files.

A checkpoint in the release's layout, random weights: config.json through
transformers' `Gemma3Config` (SigLIP vision config, Gemma 3 text config with
its sliding and global layers), the weights of transformers'
`Gemma3ForConditionalGeneration` (tied head), preprocessor_config.json
(`Gemma3ImageProcessor`), processor_config.json (`image_seq_length`), the
release's chat template, and a byte-level BPE tokenizer trained locally with
Gemma's special tokens (`<start_of_image>`, `<end_of_image>`,
`<image_soft_token>` named as the release's tokenizer names them: `boi_token`,
`eoi_token`, `image_token`).

As for every family (epd/families/random_checkpoints.py), the final norm is scaled so
logits are peaked (greedy argmax is never decided by rounding noise). The
release initialises every Gemma norm weight and the projector's weight to
zero; here they are random, so a checkpoint whose norms were read as plain
RMSNorm, or whose projector were left out, gives other tokens.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from epd.families.random_checkpoints import LOGIT_STD, build_tokenizer, embed_chat_template, random_model

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>",
                  "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
BOI_TOKEN, EOI_TOKEN, IMAGE_TOKEN = "<start_of_image>", "<end_of_image>", "<image_soft_token>"

# Gemma 3's chat template (google/gemma-3-4b-it): the system message folded into the first
# user turn, "model" for the assistant, one <start_of_image> per image part.
CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)


@dataclass(frozen=True)
class Gemma3Preset:
    """Architecture of one Gemma 3 checkpoint preset (text decoder + SigLIP tower)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    query_pre_attn_scalar: float
    sliding_window: int
    layer_types: tuple[str, ...]  # "sliding_attention" or "full_attention", one per layer
    vision_layers: int
    vision_hidden: int
    vision_heads: int
    vision_intermediate: int
    image_size: int  # the tower's input side, pixels
    patch_size: int
    mm_tokens_per_image: int  # a square: (image_size / patch_size)^2 patches pooled to this many
    tokenizer_vocab: int
    vocab_size: int | None = None  # None: exactly the tokenizer's size
    dtype: str = "float32"  # dtype the weights are stored in
    rope_theta: float = 1_000_000.0  # global layers
    rope_local_base_freq: float = 10_000.0  # sliding layers
    rope_scaling: dict = field(default_factory=lambda: {"rope_type": "linear", "factor": 8.0})
    max_position_embeddings: int = 131_072
    final_logit_softcapping: float | None = None


PRESETS: dict[str, Gemma3Preset] = {
    # For tests: loads in well under a second. A global layer between sliding ones, a window shorter
    # than most test prompts, a query scale that is not head_dim's; 8x8 patches pooled to 4x4 tokens.
    "gemma3-tiny": Gemma3Preset(
        hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
        query_pre_attn_scalar=24, sliding_window=32,
        layer_types=("sliding_attention", "sliding_attention", "full_attention", "sliding_attention"),
        vision_layers=2, vision_hidden=32, vision_heads=2, vision_intermediate=64,
        image_size=64, patch_size=8, mm_tokens_per_image=16, tokenizer_vocab=1024,
        max_position_embeddings=8192,
    ),
    # For CPU benchmarks and vLLM's CPU build (head_dim 64: a size its attention takes): ~110M
    # parameters, a global layer after every five sliding ones, a 448x448 image -> 256 tokens.
    "gemma3-small": Gemma3Preset(
        hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, head_dim=64, intermediate_size=2304,
        query_pre_attn_scalar=64, sliding_window=512,
        layer_types=tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(12)),
        vision_layers=8, vision_hidden=512, vision_heads=8, vision_intermediate=1536,
        image_size=448, patch_size=14, mm_tokens_per_image=256, tokenizer_vocab=8192,
        max_position_embeddings=32768,
    ),
    # Published shapes of gemma-3-4b-it (5 sliding layers per global one), for GPU runs.
    "gemma3-4b": Gemma3Preset(
        hidden_size=2560, num_layers=34, num_heads=8, num_kv_heads=4, head_dim=256, intermediate_size=10240,
        query_pre_attn_scalar=256, sliding_window=1024,
        layer_types=tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(34)),
        vision_layers=27, vision_hidden=1152, vision_heads=16, vision_intermediate=4304,
        image_size=896, patch_size=14, mm_tokens_per_image=256, tokenizer_vocab=8192, vocab_size=262_208,
        dtype="bfloat16",
    ),
}


def _release_tower_names(out: Path) -> None:
    """The tower's tensors under the releases' `vision_tower.vision_model.*` (transformers saves
    `vision_tower.*`; vLLM reads only the releases' names, transformers and EPD read both)."""
    from safetensors.torch import load_file, save_file

    def release(name: str) -> str:
        if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
            return "vision_tower.vision_model." + name[len("vision_tower."):]
        return name

    for path in sorted(out.glob("*.safetensors")):
        tensors = load_file(path)
        save_file({release(k): v for k, v in tensors.items()}, path, metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    if index.exists():
        cfg = json.loads(index.read_text())
        cfg["weight_map"] = {release(k): v for k, v in cfg["weight_map"].items()}
        index.write_text(json.dumps(cfg, indent=2))


def gemma3_tokenizer(vocab_size: int):
    """A byte-level BPE with Gemma's special tokens (pad 0, eos 1, bos 2 as in the release), the
    release's named image tokens, and its runs of newlines as single tokens ("\n" .. "\n\n\n\n",
    as the release's vocabulary has them and vLLM's Gemma 3 processor looks them up)."""
    tokenizer = build_tokenizer(vocab_size, SPECIAL_TOKENS, eos_token="<eos>", pad_token="<pad>",
                                chat_template=CHAT_TEMPLATE, bos_token="<bos>", unk_token="<unk>",
                                boi_token=BOI_TOKEN, eoi_token=EOI_TOKEN, image_token=IMAGE_TOKEN)
    tokenizer.add_tokens(["\n" * k for k in range(1, 5)])
    return tokenizer


def hf_config(p: Gemma3Preset, ids: dict[str, int], vocab_size: int):
    """The transformers `Gemma3Config` of a preset."""
    from transformers import Gemma3Config

    text = dict(
        vocab_size=vocab_size, hidden_size=p.hidden_size, intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_layers, num_attention_heads=p.num_heads, num_key_value_heads=p.num_kv_heads,
        head_dim=p.head_dim, query_pre_attn_scalar=p.query_pre_attn_scalar, sliding_window=p.sliding_window,
        layer_types=list(p.layer_types), max_position_embeddings=p.max_position_embeddings, rms_norm_eps=1e-6,
        final_logit_softcapping=p.final_logit_softcapping, attn_logit_softcapping=None,
        rope_parameters={"full_attention": {"rope_theta": p.rope_theta, **p.rope_scaling},
                         "sliding_attention": {"rope_type": "default", "rope_theta": p.rope_local_base_freq}},
        pad_token_id=ids["<pad>"], eos_token_id=ids["<eos>"], bos_token_id=ids["<bos>"],
    )
    vision = dict(hidden_size=p.vision_hidden, intermediate_size=p.vision_intermediate,
                  num_hidden_layers=p.vision_layers, num_attention_heads=p.vision_heads,
                  image_size=p.image_size, patch_size=p.patch_size, vision_use_head=False)
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=p.mm_tokens_per_image,
                        boi_token_index=ids[BOI_TOKEN], eoi_token_index=ids[EOI_TOKEN],
                        image_token_index=ids[IMAGE_TOKEN], tie_word_embeddings=True)


def write_checkpoint(out: Path, p: Gemma3Preset, seed: int) -> None:
    """The preset's random-weight checkpoint, tokenizer and processor files in `out`
    (epd/tools/make_model.py `make_model`)."""
    from transformers import GenerationConfig, Gemma3ForConditionalGeneration

    tokenizer = gemma3_tokenizer(p.tokenizer_vocab)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab_size = p.vocab_size or len(tokenizer)
    assert vocab_size >= len(tokenizer), "the model's vocab must cover the tokenizer"
    config = hf_config(p, ids, vocab_size)

    model = random_model(lambda: Gemma3ForConditionalGeneration(config), p.dtype, seed)
    _randomize(model, p)
    model.save_pretrained(out, safe_serialization=True)
    _release_tower_names(out)

    GenerationConfig(bos_token_id=ids["<bos>"], eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]],
                     pad_token_id=ids["<pad>"], do_sample=False).save_pretrained(out)
    tokenizer.save_pretrained(out)
    embed_chat_template(out, CHAT_TEMPLATE)
    write_processor_configs(out, p)


def _randomize(model, p: Gemma3Preset) -> None:
    """Random Gemma norm and projector weights (the release's init makes them zero), and the
    final norm scaled for peaked logits: logit std ~ LOGIT_STD."""
    import torch

    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") and "vision_tower" not in name:  # Gemma's (1 + w) norms
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
        proj = model.model.multi_modal_projector.mm_input_projection_weight  # [vision hidden, hidden]
        proj.copy_(torch.randn(proj.shape, generator=gen) / p.vision_hidden ** 0.5)
        lm = model.model.language_model
        init_std = lm.embed_tokens.weight.float().std().item()  # the tied head's
        lm.norm.weight.fill_(LOGIT_STD / (init_std * p.hidden_size ** 0.5) - 1.0)


def write_processor_configs(out: Path, p: Gemma3Preset) -> None:
    """preprocessor_config.json and processor_config.json as the release writes them."""
    pre = {
        "do_convert_rgb": None,
        "do_normalize": True,
        "do_pan_and_scan": None,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_processor_type": "Gemma3ImageProcessor",
        "image_seq_length": p.mm_tokens_per_image,
        "image_std": [0.5, 0.5, 0.5],
        "pan_and_scan_max_num_crops": None,
        "pan_and_scan_min_crop_size": None,
        "pan_and_scan_min_ratio_to_activate": None,
        "processor_class": "Gemma3Processor",
        "resample": 2,
        "rescale_factor": 1 / 255,
        "size": {"height": p.image_size, "width": p.image_size},
    }
    (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=2) + "\n")
    proc = {"image_seq_length": p.mm_tokens_per_image, "processor_class": "Gemma3Processor"}
    (out / "processor_config.json").write_text(json.dumps(proc, indent=2) + "\n")
