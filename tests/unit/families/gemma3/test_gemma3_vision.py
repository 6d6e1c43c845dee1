"""Gemma 3's vision side and prompt format against transformers on a tiny random checkpoint:
the tower + projector's embeddings equal `get_image_features` (float32), and the prompt our
PromptBuilder makes (GEMMA3_FORMAT, Gemma3Geometry) is Gemma3Processor's, token for token."""
from __future__ import annotations

import io

import pytest
import torch
from PIL import Image
from testkit.media import IMG_A, IMG_B

from epd.families.gemma3.prompt_format import GEMMA3_FORMAT, Gemma3Geometry
from epd.families.gemma3.vision import load_vision
from epd.inputs.prompt import ImageRef, PromptBuilder

IMAGES = [Image.open(io.BytesIO(b)).convert("RGB") for b in (IMG_A, IMG_B)]  # 100x60 and 37x150
CHATS = {
    "text_only": [{"role": "user", "content": "Tell me about the red chair."}],
    "one_image": [{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}],
    "two_images": [{"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image"},
                                                {"type": "image"}, {"type": "text", "text": "these."}]}],
}


def test_embeddings_equal_transformers(gemma3_model, gemma3_reference):
    from transformers import AutoConfig

    model, _ = gemma3_reference
    vision = load_vision(gemma3_model, AutoConfig.from_pretrained(gemma3_model), torch.float32)
    pixels, metas = vision.preprocess(IMAGES)
    with torch.no_grad():
        entries = vision.forward(pixels, metas)
        want = model.model.get_image_features(pixels).pooler_output  # [2, 16, hidden]
    assert [tuple(e.embeddings.shape) for e in entries] == [(16, 64)] * 2
    for entry, ref in zip(entries, want):
        assert entry.extras == {} and ref.abs().max() > 0.1
        torch.testing.assert_close(entry.embeddings, ref, rtol=1e-5, atol=1e-5)
    assert vision.patches(100, 60) == 64  # (64 / 8)² patches, whatever the image's size


@pytest.mark.parametrize("case", list(CHATS))
def test_prompt_is_the_processors(gemma3_model, gemma3_reference, case):
    from transformers import AutoTokenizer

    _, processor = gemma3_reference
    messages = CHATS[case]
    images = IMAGES[:sum(p["type"] == "image" for m in messages if not isinstance(m["content"], str)
                         for p in m["content"])]
    geometry = Gemma3Geometry.from_pretrained(gemma3_model)
    image_token_id = processor.tokenizer.image_token_id
    builder = PromptBuilder(AutoTokenizer.from_pretrained(gemma3_model), geometry, image_token_id,
                            prompt_format=GEMMA3_FORMAT)
    prompt = builder.build(messages, [ImageRef(im.width, im.height, f"{i:064x}") for i, im in enumerate(images)])
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want = processor(text=text, images=images or None, return_tensors="pt")
    assert prompt.token_ids == want["input_ids"][0].tolist()
    is_image = want["token_type_ids"][0].bool()
    assert [(s.offset, s.length) for s in prompt.mm_spans] == _runs(is_image.tolist())
    assert all(s.length == 16 for s in prompt.mm_spans)


def _runs(flags: list[bool]) -> list[tuple[int, int]]:
    runs, i = [], 0
    while i < len(flags):
        j = i
        while j < len(flags) and flags[j]:
            j += 1
        if j > i:
            runs.append((i, j - i))
        i = j + 1
    return runs


def test_expansion_is_the_processors_sequence(gemma3_reference):
    _, processor = gemma3_reference
    assert GEMMA3_FORMAT.expand_image(processor.image_seq_length) == processor.full_image_sequence


def test_an_unknown_processor_key_is_refused_and_pan_and_scan_off_keeps_one_crop(gemma3_model):
    with pytest.raises(ValueError, match="size"):
        Gemma3Geometry.from_pretrained(gemma3_model, {"size": {"height": 32, "width": 32}})
    assert Gemma3Geometry.from_pretrained(gemma3_model, {"do_pan_and_scan": False}).num_image_tokens(9, 900) == 16
    assert Gemma3Geometry.from_pretrained(gemma3_model, {"do_pan_and_scan": True}).num_image_tokens(9, 900) == 16
