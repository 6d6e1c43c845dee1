"""transformers' InternVLForConditionalGeneration as the reference on an
InternVL checkpoint: the chat template's text, each `<IMG_CONTEXT>` expanded as
InternVLProcessor does (`<img>` + one token per tile token + `</img>`, the
tiles counted by the image processor on the decoded image, cropped as the
processor asks), and one full forward per generated token. (The whole
InternVLProcessor needs torchvision for its video processor; its token ids
are compared with ours in tests/unit/families/internvl.)"""
from __future__ import annotations

import io
from functools import lru_cache

import torch
from PIL import Image

TOP = 5


@lru_cache(maxsize=4)
def _load(model_dir: str):
    import json
    from pathlib import Path

    from transformers import AutoImageProcessor, AutoTokenizer, InternVLForConditionalGeneration

    model = InternVLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens_per_tile = json.loads((Path(model_dir) / "processor_config.json").read_text())["image_seq_length"]
    return model, AutoTokenizer.from_pretrained(model_dir), AutoImageProcessor.from_pretrained(model_dir), \
        tokens_per_tile


def _template_messages(messages: list[dict]) -> list[dict]:
    return [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
             [p if p["type"] == "text" else {"type": "image"} for p in m["content"]]} for m in messages]


def hf_inputs(model_dir: str, messages: list[dict], images: list[bytes]) -> dict:
    """input_ids [1, L] and, with images, pixel_values [tiles, 3, size, size]."""
    model, tok, ip, tokens_per_tile = _load(model_dir)
    text = tok.apply_chat_template(_template_messages(messages), tokenize=False, add_generation_prompt=True)
    inputs: dict = {}
    if images:
        pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
        px = ip(images=pil, crop_to_patches=True, return_tensors="pt")  # InternVLProcessor's default
        inputs["pixel_values"] = px["pixel_values"]
        pieces = text.split(tok.context_image_token)
        text = pieces[0] + "".join(
            f"{tok.start_image_token}{tok.context_image_token * tokens_per_tile * int(n)}{tok.end_image_token}{p}"
            for n, p in zip(px["num_patches"], pieces[1:]))
    inputs["input_ids"] = torch.tensor([tok.encode(text, add_special_tokens=False)])
    return inputs


@torch.no_grad()
def hf_greedy_logprobs(model_dir: str, messages: list[dict], images: list[bytes], num_tokens: int
                       ) -> tuple[list[int], list[int], list[list[tuple[int, float]]]]:
    """(prompt ids, greedy tokens, each step's top-5 (token, logprob)); EOS ignored."""
    model = _load(model_dir)[0]
    inputs = hf_inputs(model_dir, messages, images)
    ids = inputs["input_ids"]
    prompt, tokens, logprobs = ids[0].tolist(), [], []
    for _ in range(num_tokens):
        logits = model(**dict(inputs, input_ids=ids)).logits[0, -1]
        token = int(logits.argmax())
        tokens.append(token)
        top = torch.log_softmax(logits.float(), -1).topk(TOP)
        logprobs.append(list(zip(top.indices.tolist(), top.values.tolist())))
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return prompt, tokens, logprobs


@torch.no_grad()
def hf_generate_text(model_dir: str, messages: list[dict], images: list[bytes], max_new_tokens: int) -> str:
    """transformers' generate(), greedy, stopping at EOS as a user would run it."""
    model, tok, _, _ = _load(model_dir)
    inputs = hf_inputs(model_dir, messages, images)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
