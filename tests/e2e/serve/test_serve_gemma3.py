"""`epd serve` of Gemma 3 in each mode (e-p-d, e-pd, aggregated): a text chat and a two-image chat give
transformers' greedy text (Gemma3ForConditionalGeneration on the same gemma3-tiny checkpoint,
float32), plain and streamed. e-p-d hands the SigLIP embeddings from an encoder worker through
the embedding cache to a prefill worker, and its KV to a decode worker; aggregated encodes
in-process. The prompts are longer than the checkpoint's sliding window, and an image's tokens
attend to each other both ways (the processor's `token_type_ids` in the reference). With
pan-and-scan on (--mm-processor-kwargs), e-p-d's greedy tokens and top-5 logprobs of a one- and
a two-image chat are transformers' (each image its original and crops)."""
from __future__ import annotations

import io
import json

import pytest
import torch
from PIL import Image
from testkit.media import CHATS
from testkit.server import chat_text, served_top5, start_server

MAX_TOKENS = 10
CHAT_NAMES = ["text_only", "two_images"]
# small enough a crop for the test images (100x60, 37x150) to be cut into 2 and 4
PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16}


@pytest.fixture(scope="module")
def gemma3_model(tmp_path_factory) -> str:
    from epd.tools.make_model import make_model

    return str(make_model(tmp_path_factory.mktemp("ckpt") / "gemma3-tiny", "gemma3-tiny", seed=3))


@torch.no_grad()
def reference_text(model_dir: str, messages: list[dict], images: list[bytes]) -> str:
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    inputs = _inputs(processor, messages, images)
    out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def _inputs(processor, messages: list[dict], images: list[bytes], **processor_kwargs):
    chat = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
             [p if p["type"] == "text" else {"type": "image"} for p in m["content"]]} for m in messages]
    text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    return processor(text=text, images=pil or None, return_tensors="pt", **processor_kwargs)


@torch.no_grad()
def reference_top5(model_dir: str, messages: list[dict], images: list[bytes]) -> list[list[tuple[int, float]]]:
    """transformers' greedy steps with pan-and-scan on: each step's top-5 (token id, logprob), the
    greedy token first."""
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = _inputs(AutoProcessor.from_pretrained(model_dir), messages, images, **PAN_AND_SCAN)
    out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    top = torch.log_softmax(torch.cat(out.logits).float(), dim=-1).topk(5)  # [MAX_TOKENS, 5]
    return [list(zip(ids, values)) for ids, values in zip(top.indices.tolist(), top.values.tolist())]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["e-pd", "aggregated"])  # e-p-d: with pan-and-scan, below
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


@pytest.mark.slow
def test_served_pan_and_scan_equals_transformers(gemma3_model, tmp_path):
    names = ["one_image", "two_images"]
    expected = {n: reference_top5(gemma3_model, *CHATS[n]) for n in names}
    expected_text = reference_text(gemma3_model, *CHATS["text_only"])
    srv = start_server(gemma3_model, tmp_path, "e-p-d", "--mm-processor-kwargs", json.dumps(PAN_AND_SCAN))
    try:
        assert expected_text
        assert chat_text(srv, CHATS["text_only"][0], MAX_TOKENS) == expected_text
        assert chat_text(srv, CHATS["text_only"][0], MAX_TOKENS, stream=True) == expected_text
        for name in names:
            got, _ = served_top5(srv, CHATS[name][0], MAX_TOKENS)
            assert [[i for i, _ in step] for step in got] == [[i for i, _ in step] for step in expected[name]], name
            torch.testing.assert_close(torch.tensor([[lp for _, lp in step] for step in got]),
                                       torch.tensor([[lp for _, lp in step] for step in expected[name]]),
                                       rtol=0, atol=1e-4)
        # each image counted once, however many runs it is written as
        assert (srv.metric_sum("epd:request_images_count"), srv.metric_sum("epd:request_images_sum")) == (2, 3)
    finally:
        assert srv.stop() == 0, srv.log()
