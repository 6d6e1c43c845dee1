"""`python -m bench.dev.greedy_reference CKPT VS_VLLM_JSON`: whose greedy texts of a
`bench.dev.vs_vllm --greedy-only` run are transformers', and how close transformers' choice was
where a server's text leaves it.

transformers (the family's `AutoModelForImageTextToText` class, float32 or `--dtype`) runs the run's three
chats again (the text prompt, the one- and two-image prompts, rebuilt from the seed as
vs_vllm.greedy_texts draws them) and decodes greedily. For each server and prompt it prints
whether the text is transformers', else the first step where it leaves transformers' and the
gap there between transformers' first and second logit: a gap of a few 1e-3 or less is a tie
float32 rounding may break either way; a larger one is a different reading of the model.
"""
from __future__ import annotations

import argparse
import base64
import io
import json

# model_type -> the image token the template writes once and the processor repeats once per merged patch,
# for the families whose processor needs torchvision (its video processor) to load
IMAGE_TOKENS = {"glm4v": "<|image|>", "glm4v_moe": "<|image|>", "qwen3_5": "<|image_pad|>",
                "qwen3_5_moe": "<|image_pad|>"}


def model_inputs(model, model_dir: str, request) -> dict:
    """transformers' inputs for one vs_vllm request: its processor's, or (where the processor
    needs torchvision for its video half, as GLM's does) the image processor's pixels and the
    template's image token repeated once per merged patch, as the processor does."""
    import inspect

    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    images = [Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")
              for url in request.image_urls]
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": request.prompt}]
    messages = [{"role": "user", "content": content}]
    if model.config.model_type not in IMAGE_TOKENS:
        processor = AutoProcessor.from_pretrained(model_dir)
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
        return dict(processor(text=prompt, images=images or None, return_tensors="pt"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = {}
    if images:
        image_processor = AutoImageProcessor.from_pretrained(model_dir)
        pixels = image_processor(images=images, return_tensors="pt")
        inputs.update(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
        token, merge = IMAGE_TOKENS[model.config.model_type], image_processor.merge_size ** 2
        pieces = text.split(token)
        text = pieces[0] + "".join(token * int(g.prod() // merge) + p
                                   for g, p in zip(pixels["image_grid_thw"], pieces[1:]))
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    inputs["input_ids"] = ids
    if "mm_token_type_ids" in inspect.signature(type(model).forward).parameters:
        inputs["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
    return inputs


def reference(model, inputs: dict, n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy token ids and the top-1 minus top-2 logit at each step."""
    import torch

    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    ids = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    gaps = [a - b for a, b in (step[0].float().topk(2).values.tolist() for step in out.logits)]
    return ids, gaps


def where_it_leaves(text: str, ids: list[int], tokenizer) -> int | None:
    """The first step whose token takes transformers' decoded text away from `text` (None: equal)."""
    for i in range(len(ids)):
        if not text.startswith(tokenizer.decode(ids[:i + 1], skip_special_tokens=True)):
            return i
    return None


def main(args) -> None:
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from epd.bench.datasets import load_tokenizer, sample_random, sample_random_mm

    run = json.loads(open(args.vs_vllm_json).read())
    texts, config = run["greedy"]["texts"], run["config"]
    size = [tuple(int(x) for x in config["image_size"].split("x"))]
    tokenizer = load_tokenizer(args.checkpoint)
    hf_tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    model = AutoModelForImageTextToText.from_pretrained(args.checkpoint, dtype=getattr(torch, args.dtype)).eval()
    n, seed = config["greedy_tokens"], config["seed"]
    requests = sample_random(1, 32, n, seed=seed, tokenizer=tokenizer)  # vs_vllm.greedy_texts' order
    for k in (1, 2):
        requests += sample_random_mm(1, 32, n, images_per_request=k, image_sizes=size, seed=seed + k,
                                     tokenizer=tokenizer)
    for k, request in enumerate(requests):
        ids, gaps = reference(model, model_inputs(model, args.checkpoint, request), n)
        for server, outs in texts.items():
            step = where_it_leaves(outs[k], ids, hf_tokenizer)
            same = outs[k] == hf_tokenizer.decode(ids, skip_special_tokens=True)
            verdict = ("transformers' text" if same else "transformers' text, then more" if step is None else
                       f"leaves transformers' at token {step}, where its first and second logits are "
                       f"{gaps[step]:.4f} apart")
            print(f"{k} image(s), {server}: {verdict}", flush=True)
        print(f"{k} image(s): transformers' smallest first-second logit gap over its {n} tokens "
              f"{min(gaps):.4f}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.dev.greedy_reference", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("vs_vllm_json")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="transformers' dtype: bfloat16 where the servers ran in it (vLLM's CPU Gated DeltaNet)")
    main(parser.parse_args())
