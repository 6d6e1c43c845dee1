"""Checkpoints in the file layout of the Hugging Face releases, made from a
tiny one (tests/conftest.py `tiny_model`; nothing is downloaded).

Qwen3-VL's releases keep the chat template in `chat_template.json` (the
processor's file) and none in `tokenizer_config.json`, and their
`generation_config.json` asks for temperature 0.7, top_p 0.8, top_k 20;
Qwen2.5-VL's adds repetition_penalty 1.05. Weights are linked, not copied.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

QWEN3_VL_SAMPLING = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20}
# near-greedy with a repetition penalty, as Qwen2.5-VL's releases
QWEN2_5_VL_SAMPLING = {"do_sample": True, "temperature": 0.1, "top_p": 0.001, "top_k": 1, "repetition_penalty": 1.05}
# what a request that spells out vLLM's neutral values gets
NEUTRAL_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
PROCESSOR_TEMPLATE_MARK = "Served with the processor template."
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json")  # a text-only release has neither


def release_checkpoint(tiny_model: str, out: Path, sampling: dict | None = None, *,
                       tokenizer_template: bool = False, image_processor: bool = True,
                       template: str | None = None) -> str:
    """A copy of `tiny_model` in a release's layout: the template (`template`, e.g.
    testkit.release_templates.QWEN3_VL; None: the tiny model's) only in
    chat_template.json, `sampling` merged into generation_config.json.
    `tokenizer_template`: tokenizer_config.json keeps its template too, and the one
    in chat_template.json differs from it (a system line `PROCESSOR_TEMPLATE_MARK`).
    `image_processor` False: no preprocessor_config.json nor video one (text only)."""
    src = Path(tiny_model)
    out.mkdir(parents=True)
    for path in src.iterdir():
        if path.suffix == ".safetensors":
            (out / path.name).symlink_to(path)
        elif path.name != "chat_template.jinja" and (image_processor or path.name not in PROCESSOR_FILES):
            shutil.copy(path, out / path.name)
    tok_cfg = json.loads((src / "tokenizer_config.json").read_text())
    template = template or tok_cfg["chat_template"]
    if tokenizer_template:
        template = "{{- '<|im_start|>system\\n" + PROCESSOR_TEMPLATE_MARK + "<|im_end|>\\n' }}" + template
    else:
        del tok_cfg["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": template}, indent=2))
    gen = json.loads((src / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**gen, **(sampling or {})}, indent=2))
    return str(out)


def processor_template(model_dir: str) -> str:
    return json.loads((Path(model_dir) / "chat_template.json").read_text())["chat_template"]
