"""`epd serve` of Gemma 3 in each mode (e-p-d, e-pd, aggregated): a text chat and a two-image chat give
transformers' greedy text (Gemma3ForConditionalGeneration on the same gemma3-tiny checkpoint,
float32), plain and streamed. e-p-d hands the SigLIP embeddings from an encoder worker through
the embedding cache to a prefill worker, and its KV to a decode worker; aggregated encodes
in-process. The prompts are longer than the checkpoint's sliding window, and an image's tokens
attend to each other both ways (the processor's `token_type_ids` in the reference)."""
from __future__ import annotations

import io

import pytest
import torch
from PIL import Image
from testkit.media import CHATS
from testkit.server import chat_text, start_server

MAX_TOKENS = 10
CHAT_NAMES = ["text_only", "two_images"]


@pytest.fixture(scope="module")
def gemma3_model(tmp_path_factory) -> str:
    from epd.tools.make_model import make_model

    return str(make_model(tmp_path_factory.mktemp("ckpt") / "gemma3-tiny", "gemma3-tiny", seed=3))


@torch.no_grad()
def reference_text(model_dir: str, messages: list[dict], images: list[bytes]) -> str:
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    chat = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
             [p if p["type"] == "text" else {"type": "image"} for p in m["content"]]} for m in messages]
    text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    inputs = processor(text=text, images=pil or None, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["e-p-d", "e-pd", "aggregated"])
def test_served_text_equals_transformers(gemma3_model, mode, tmp_path):
    expected = {n: reference_text(gemma3_model, *CHATS[n]) for n in CHAT_NAMES}
    assert all(expected.values())
    srv = start_server(gemma3_model, tmp_path, mode)
    try:
        for name in CHAT_NAMES:
            assert chat_text(srv, CHATS[name][0], MAX_TOKENS) == expected[name], name
            assert chat_text(srv, CHATS[name][0], MAX_TOKENS, stream=True) == expected[name], name
    finally:
        assert srv.stop() == 0, srv.log()
    assert not srv.group_alive(), "a server process survived Ctrl-C"
