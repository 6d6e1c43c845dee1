"""LoRA adapters made with peft on a test checkpoint, and transformers + peft's
greedy tokens with them: the reference EPD's adapters must match.

`make_adapter` builds a PEFT LoRA on transformers' model of the checkpoint,
with B matrices drawn at random (peft starts them at zero, which would change
nothing), and saves it in PEFT's format (adapter_config.json +
adapter_model.safetensors). `peft_greedy` loads the base model once with
every adapter and decodes greedily, one full forward per token, the adapter
(or none) chosen per prompt. `peft_image_greedy` does the same for a chat with
images (tower adapters: `TOWER_MODULES`), with each token's logprob.
"""
from __future__ import annotations

from pathlib import Path

import torch

from testkit.hf_reference import REFERENCE_CLASSES, _takes_mm_token_types

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _base_model(model_dir: str):
    import json

    import transformers

    model_type = json.loads((Path(model_dir) / "config.json").read_text())["model_type"]
    model_cls = getattr(transformers, REFERENCE_CLASSES[model_type])
    return model_cls.from_pretrained(model_dir, dtype=torch.float32).eval()


def make_adapter(model_dir: str, out_dir: str | Path, target_modules=ALL_MODULES, r: int = 8,
                 lora_alpha: float = 16, use_rslora: bool = False, seed: int = 0, scale: float = 0.3) -> str:
    """A PEFT adapter on the language model's `target_modules`, random non-zero A and B."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=lora_alpha, use_rslora=use_rslora, target_modules=list(target_modules),
                        lora_dropout=0.0, bias="none")
    model = get_peft_model(_base_model(model_dir), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, scale)
    model.save_pretrained(str(out_dir))
    return str(out_dir)


@torch.no_grad()
def peft_greedy(model_dir: str, adapters: dict[str, str], prompts: list[list[int]], names: list[str | None],
                num_tokens: int) -> list[list[int]]:
    """Per prompt, greedy tokens of the base model with adapter `names[i]` (None: no adapter), EOS ignored."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is ~30x faster than many on a shared CPU
    try:
        return _greedy(model_dir, adapters, prompts, names, num_tokens)
    finally:
        torch.set_num_threads(threads)


def _greedy(model_dir: str, adapters: dict[str, str], prompts: list[list[int]], names: list[str | None],
            num_tokens: int) -> list[list[int]]:
    from peft import PeftModel

    base = _base_model(model_dir)
    first, *rest = adapters.items()
    model = PeftModel.from_pretrained(base, first[1], adapter_name=first[0]).eval()
    for name, path in rest:
        model.load_adapter(path, adapter_name=name)
    token_types = _takes_mm_token_types(base)  # newer transformers want them (zeros: text only)
    outputs = []
    for prompt, name in zip(prompts, names):
        ids = torch.tensor([prompt])
        out = []
        for _ in range(num_tokens):
            inputs = {"input_ids": ids, **({"mm_token_type_ids": torch.zeros_like(ids)} if token_types else {})}
            if name is None:
                with model.disable_adapter():
                    logits = model(**inputs).logits
            else:
                model.set_adapter(name)
                logits = model(**inputs).logits
            nxt = int(logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        outputs.append(out)
    return outputs


# The vision tower's projections as PEFT targets them on transformers' Qwen3-VL (a bare
# linear_fc1 / linear_fc2 adapts the mergers' too); "attn.proj" leaves the patch embedding alone.
TOWER_MODULES = ("qkv", "attn.proj", "linear_fc1", "linear_fc2")


@torch.no_grad()
def peft_image_greedy(model_dir: str, adapters: dict[str, str], messages: list[dict], images: list[bytes],
                      names: list[str | None], num_tokens: int) -> list[tuple[list[int], list[float]]]:
    """Per adapter name (None: the base model), transformers + peft's greedy tokens for a
    chat with images, and each token's logprob; one full forward per token, EOS ignored."""
    from peft import PeftModel

    from testkit.hf_reference import _mm_token_types, hf_inputs

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        base = _base_model(model_dir)
        first, *rest = adapters.items()
        model = PeftModel.from_pretrained(base, first[1], adapter_name=first[0]).eval()
        for name, path in rest:
            model.load_adapter(path, adapter_name=name)
        inputs = hf_inputs(model_dir, messages, images)
        out = []
        for name in names:
            ids, tokens, logprobs = inputs["input_ids"], [], []
            for _ in range(num_tokens):
                step = dict(inputs, input_ids=ids)
                if "mm_token_type_ids" in inputs:
                    step["mm_token_type_ids"] = _mm_token_types(base, ids)
                if name is None:
                    with model.disable_adapter():
                        logits = model(**step).logits[0, -1]
                else:
                    model.set_adapter(name)
                    logits = model(**step).logits[0, -1]
                nxt = int(logits.argmax())
                tokens.append(nxt)
                logprobs.append(float(torch.log_softmax(logits.float(), -1)[nxt]))
                ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
            out.append((tokens, logprobs))
        return out
    finally:
        torch.set_num_threads(threads)
