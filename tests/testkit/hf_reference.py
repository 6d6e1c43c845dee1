"""transformers' own model of the checkpoint's family (Qwen3-VL, Qwen3-VL-MoE,
Qwen2.5-VL) as the reference: its image processor decodes the
pixels, the placeholder expansion follows Qwen3VLProcessor (grid from the
decoded image), and its model computes the logits. With videos, the prompt's
token ids and the video tensors come from transformers' whole processor run on
the whole chat text in a child process (tests/testkit/video_reference.py
hf_processor_inputs), images still decoded here by the PIL image processor."""
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
    "glm4v": "Glm4vForConditionalGeneration",
    "glm4v_moe": "Glm4vMoeForConditionalGeneration",
    "internvl": "InternVLForConditionalGeneration",
    "gemma3": "Gemma3ForConditionalGeneration",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
}
# model_type -> the token its processor repeats once per image placeholder position (Qwen's by default)
IMAGE_PADS = {"glm4v": "<|image|>", "glm4v_moe": "<|image|>"}


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
            c = [p if p["type"] == "text" else {"type": "video"} if p["type"] in ("video", "video_url")
                 else {"type": "image"} for p in c]
        out.append({"role": m["role"], "content": c})
    return out


def hf_inputs(model_dir: str, messages: list[dict], images: list[bytes], videos=None,
              chat_template: str | None = None) -> dict:
    """The model's inputs for the chat: `videos` a testkit.video_reference.VideoClips
    (their token ids and tensors from transformers' processor on the whole chat text);
    `chat_template` None: the tokenizer's."""
    model, tok, ip = _load(model_dir)
    text = tok.apply_chat_template(_template_messages(messages), tokenize=False, add_generation_prompt=True,
                                   chat_template=chat_template)
    inputs: dict = {}
    if images:
        pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
        px = ip(images=pil, return_tensors="pt")
        inputs.update(pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"])
    if videos:
        from testkit.video_reference import hf_processor_inputs

        out = hf_processor_inputs(model_dir, text, videos, images)
        inputs.update(pixel_values_videos=out["pixel_values_videos"], video_grid_thw=out["video_grid_thw"])
        if out["second_per_grid_ts"] is not None:
            inputs["second_per_grid_ts"] = out["second_per_grid_ts"]
        if images:  # the child's image processor placed the pads: the same grids as the pixels here
            assert torch.equal(out["image_grid_thw"], px["image_grid_thw"])
        ids = out["input_ids"]
    else:
        if images:
            merge = ip.merge_size ** 2
            pad = IMAGE_PADS.get(model.config.model_type, "<|image_pad|>")
            pieces = text.split(pad)
            text = pieces[0] + "".join(pad * int(g.prod() // merge) + p
                                       for g, p in zip(px["image_grid_thw"], pieces[1:]))
        ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    inputs["input_ids"] = ids
    if _takes_mm_token_types(model):
        inputs["mm_token_type_ids"] = _mm_token_types(model, ids)
    return inputs


def _mm_token_types(model, ids: torch.Tensor) -> torch.Tensor:
    """text 0, image 1, video 2 (what transformers' processor returns)."""
    return (ids == model.config.image_token_id).int() + 2 * (ids == model.config.video_token_id).int()


def _takes_mm_token_types(model) -> bool:
    """Newer transformers need `mm_token_type_ids` for M-RoPE; older ones have no such argument."""
    return "mm_token_type_ids" in inspect.signature(type(model).forward).parameters


@torch.no_grad()
def hf_prompt_logits(model_dir: str, messages: list[dict], images: list[bytes],
                     videos=None) -> tuple[list[int], torch.Tensor]:
    """(prompt token ids, logits [num_prompt_tokens, vocab])."""
    model, _, _ = _load(model_dir)
    inputs = hf_inputs(model_dir, messages, images, videos)
    return inputs["input_ids"][0].tolist(), model(**inputs).logits[0].float()


@torch.no_grad()
def hf_greedy(model_dir: str, messages: list[dict], images: list[bytes], num_tokens: int,
              videos=None, chat_template: str | None = None) -> list[int]:
    """Greedy continuation without a KV cache: one full forward per token, EOS ignored."""
    model, _, _ = _load(model_dir)
    inputs = hf_inputs(model_dir, messages, images, videos, chat_template)
    ids = inputs["input_ids"]
    out = []
    for _ in range(num_tokens):
        step = dict(inputs, input_ids=ids)
        if _takes_mm_token_types(model):
            step["mm_token_type_ids"] = _mm_token_types(model, ids)
        nxt = int(model(**step).logits[0, -1].argmax())
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


@torch.no_grad()
def hf_greedy_logprobs(model, inputs: dict, num_tokens: int, top: int) -> tuple[list[int], list[int], list[list]]:
    """(prompt ids, greedy tokens, each step's `top` most likely (token, logprob)) by transformers'
    `model` on its processor's `inputs`: one full forward a token, EOS ignored."""
    ids = inputs["input_ids"]
    prompt, tokens, logprobs = ids[0].tolist(), [], []
    for _ in range(num_tokens):
        logits = model(**dict(inputs, input_ids=ids, mm_token_type_ids=_mm_token_types(model, ids))).logits[0, -1]
        tokens.append(int(logits.argmax()))
        best = torch.log_softmax(logits.float(), -1).topk(top)
        logprobs.append(list(zip(best.indices.tolist(), best.values.tolist())))
        ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], dim=1)
    return prompt, tokens, logprobs


def assert_greedy_matches(outs, expected, atol: float = 1e-4) -> None:
    """Each of the LLM's `outs` (top logprobs asked for) has its reference's greedy tokens and,
    at every step, its top token ids in order and their logprobs within `atol`. `expected`:
    one (tokens, [top ids a step], [logprobs tensor a step]) an output."""
    for out, (tokens, top_ids, top_logprobs) in zip(outs, expected, strict=True):
        got = out.outputs[0]
        assert got.token_ids == tokens
        for step, (ids, values) in enumerate(zip(top_ids, top_logprobs)):
            top = got.logprobs[step].top  # [(token id, logprob)], most likely first
            assert [i for i, _ in top] == ids, step
            torch.testing.assert_close(torch.tensor([lp for _, lp in top]), values, rtol=0, atol=atol)


@torch.no_grad()
def hf_generate_text(model_dir: str, messages: list[dict], images: list[bytes], max_new_tokens: int,
                     videos=None) -> str:
    """transformers' generate(), greedy, stopping at EOS like a user would run it."""
    model, tok, _ = _load(model_dir)
    inputs = hf_inputs(model_dir, messages, images, videos)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
