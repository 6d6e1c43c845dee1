"""`python -m bench.dev.gemma3_image_mask CKPT VS_VLLM_JSON`: whose reading of Gemma 3 the
image prompts' greedy texts of a `bench.dev.vs_vllm --greedy-only` run follow.

transformers runs the same chats (the run's one- and two-image prompts, rebuilt from the
seed) twice: as the model is defined (an image's tokens attend to each other both ways) and
with causal attention over the image (token_type_ids zeroed). Each server's text is compared
with both. vLLM's CPU attention has no bidirectional ("mm_prefix") mode, so its texts follow
the causal run; EPD's follow the model's definition.
"""
from __future__ import annotations

import argparse
import base64
import io
import json


def main(args) -> None:
    import torch
    from PIL import Image
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    from epd.bench.datasets import load_tokenizer, sample_random_mm

    run = json.loads(open(args.vs_vllm_json).read())
    texts, config = run["greedy"]["texts"], run["config"]
    size = [tuple(int(x) for x in config["image_size"].split("x"))]
    tokenizer = load_tokenizer(args.checkpoint)
    processor = AutoProcessor.from_pretrained(args.checkpoint)
    model = Gemma3ForConditionalGeneration.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    n = config["greedy_tokens"]
    for k in (1, 2):  # vs_vllm.greedy_texts' image prompts, in its order after the text one
        request = sample_random_mm(1, 32, n, images_per_request=k, image_sizes=size, seed=config["seed"] + k,
                                   tokenizer=tokenizer)[0]
        images = [Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")
                  for url in request.image_urls]
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": request.prompt}]
        prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        inputs = processor(text=prompt, images=images, return_tensors="pt")
        readings = {}
        for name in ("bidirectional", "causal"):
            kwargs = dict(inputs)
            if name == "causal":
                kwargs["token_type_ids"] = torch.zeros_like(kwargs["token_type_ids"])
            with torch.no_grad():
                out = model.generate(**kwargs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            readings[name] = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        for server, outs in texts.items():
            same = [name for name, text in readings.items() if outs[k] == text] or ["neither"]
            print(f"{k} image(s), {server}: equals transformers {' and '.join(same)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.dev.gemma3_image_mask", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("vs_vllm_json")
    main(parser.parse_args())
