"""transformers' own model of the checkpoint's family (Qwen3-VL, Qwen3-VL-MoE,
Qwen2.5-VL) as the reference: its image processor decodes the
pixels, the placeholder expansion follows Qwen3VLProcessor (grid from the
decoded image), and its model computes the logits."""
from __future__ import annotations

import inspect
import io
from functools import lru_cache

import torch
from PIL import Image


REFERENCE_CLASSES = {  # model_type -> transformers' class
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
}


@lru_cache(maxsize=4)
def _load(model_dir: str):
    import json
    from pathlib import Path

    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    model_type = json.loads((Path(model_dir) / "config.json").read_text())["model_type"]
    model_cls = getattr(transformers, REFERENCE_CLASSES[model_type])
    model = model_cls.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir), AutoImageProcessor.from_pretrained(model_dir)


def _template_messages(messages: list[dict]) -> list[dict]:
    out = []
    for m in messages:
        c = m["content"]
        if not isinstance(c, str):
            c = [{"type": "image"} if p["type"] != "text" else p for p in c]
        out.append({"role": m["role"], "content": c})
    return out


def hf_inputs(model_dir: str, messages: list[dict], images: list[bytes]) -> dict:
    model, tok, ip = _load(model_dir)
    text = tok.apply_chat_template(_template_messages(messages), tokenize=False, add_generation_prompt=True)
    inputs: dict = {}
    if images:
        pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
        px = ip(images=pil, return_tensors="pt")
        merge = ip.merge_size ** 2
        pieces = text.split("<|image_pad|>")
        text = pieces[0] + "".join("<|image_pad|>" * int(g.prod() // merge) + p
                                   for g, p in zip(px["image_grid_thw"], pieces[1:]))
        inputs.update(pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"])
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    inputs["input_ids"] = ids
    if _takes_mm_token_types(model):
        inputs["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
    return inputs


def _takes_mm_token_types(model) -> bool:
    """Newer transformers need `mm_token_type_ids` for M-RoPE; older ones have no such argument."""
    return "mm_token_type_ids" in inspect.signature(type(model).forward).parameters


@torch.no_grad()
def hf_prompt_logits(model_dir: str, messages: list[dict], images: list[bytes]) -> tuple[list[int], torch.Tensor]:
    """(prompt token ids, logits [num_prompt_tokens, vocab])."""
    model, _, _ = _load(model_dir)
    inputs = hf_inputs(model_dir, messages, images)
    return inputs["input_ids"][0].tolist(), model(**inputs).logits[0].float()


@torch.no_grad()
def hf_greedy(model_dir: str, messages: list[dict], images: list[bytes], num_tokens: int) -> list[int]:
    """Greedy continuation without a KV cache: one full forward per token, EOS ignored."""
    model, _, _ = _load(model_dir)
    inputs = hf_inputs(model_dir, messages, images)
    ids = inputs["input_ids"]
    out = []
    for _ in range(num_tokens):
        step = dict(inputs, input_ids=ids)
        if _takes_mm_token_types(model):
            step["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
        nxt = int(model(**step).logits[0, -1].argmax())
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


@torch.no_grad()
def hf_generate_text(model_dir: str, messages: list[dict], images: list[bytes], max_new_tokens: int) -> str:
    """transformers' generate(), greedy, stopping at EOS like a user would run it."""
    model, tok, _ = _load(model_dir)
    inputs = hf_inputs(model_dir, messages, images)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
