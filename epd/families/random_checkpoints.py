"""What every family's `epd make-model` presets share (their presets.py files use it):
a byte-level BPE tokenizer trained on a built-in corpus with the family's
special tokens, its chat template kept where vLLM looks, the model drawn from a
seed in the preset's dtype (`random_model`), and the logit scale
that keeps greedy decoding decided far above float32 noise (`LOGIT_STD`: a
preset scales its final norm so the output logits have this deviation).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

LOGIT_STD = 8.0


def _corpus(seed: int = 0) -> list[str]:
    """A deterministic training corpus: English-like text, numbers, code, and
    multi-byte characters so byte-level merges cover them."""
    base = (
        "The quick brown fox jumps over the lazy dog. A picture is worth a thousand words. "
        "Describe this image in detail. What is shown in the chart? The photo shows a cat "
        "sitting on a red chair next to a window, with trees and a blue sky outside. "
        "Serving vision language models means encoding images, prefilling prompts and "
        "decoding tokens one by one. Please answer the question about the picture. "
        "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2025 3.14 1,000. "
        "def main(): return sum(x * x for x in range(10)) "
        "héllo wörld, naïve café, Größe, 你好世界, こんにちは, 안녕하세요, Привет мир 🙂🚀 "
    )
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "an", "el", "in", "on", "ur",
                 "st", "tr", "ch", "sh", "th", "qu", "pr", "gr", "bl", "pl"]
    lines = [base] * 20
    for _ in range(4000):
        words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(4, 14))]
        lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
    return lines


def build_tokenizer(vocab_size: int, special_tokens: list[str], eos_token: str, pad_token: str,
                    chat_template: str, **named_tokens: str):
    """Trains a byte-level BPE tokenizer locally and wraps it for transformers
    (`special_tokens[0]` is the pad/BOS token and is not listed as "additional");
    `named_tokens`: more of them by name, as a release's tokenizer names them
    (`bos_token`, or a family's own such as Gemma 3's `boi_token`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos_token,
        pad_token=pad_token,
        additional_special_tokens=special_tokens[1:],
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
        **named_tokens,
    )
    fast.chat_template = chat_template
    return fast


def embed_chat_template(out: Path, chat_template: str) -> None:
    """Keeps the chat template inside tokenizer_config.json (where vLLM and older
    transformers look for it) as well as in chat_template.jinja if one was written."""
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = chat_template
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def random_model(build, dtype: str, seed: int):
    """`build()`'s model in eval mode, its weights drawn after `torch.manual_seed(seed)` with
    `dtype` ("float32", "bfloat16", ...) the default dtype (restored afterwards)."""
    import torch

    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        return build().eval()
    finally:
        torch.set_default_dtype(previous)
