"""Gemma 3's pan-and-scan (`do_pan_and_scan`) against transformers on the tiny random checkpoint,
with a crop size small enough for its test images to be cut: the crop count is the image
processor's own for many sizes and settings, the prompt is Gemma3Processor's token for token
(an image: "Here is the original image", its run, "and here are some crops ...", a run per
crop), the embeddings are `get_image_features`' for the original and every crop, and the
offline `LLM` gives transformers' greedy tokens and top-5 logprobs (float32) for the mixed
batch (one and two images, cut or too square to be) over several prefill chunks, and again
from the prefix cache."""
from __future__ import annotations

import io
import itertools
import json
import random
import shutil

import pytest
import torch
from PIL import Image
from testkit.hf_reference import assert_greedy_matches
from testkit.media import BATCH_IMAGES, MIXED_BATCH, images_of

from epd.families.gemma3.prompt_format import GEMMA3_FORMAT, Gemma3Geometry, PanAndScan
from epd.families.gemma3.vision import load_vision
from epd.inputs.prompt import ImageRef, PromptBuilder
from epd.transport.wire.sampling import SamplingParams

# the test images (100x60, 37x150, 64x64, 200x90) cut into 2, 4, 0 and 2 crops
KWARGS = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16}
# the image processor alone, without Gemma3Processor's defaults for the keys left out
ALL_KWARGS = KWARGS | {"pan_and_scan_max_num_crops": 4, "pan_and_scan_min_ratio_to_activate": 1.2}
IMAGES = [Image.open(io.BytesIO(b)).convert("RGB") for b in BATCH_IMAGES]
NUM_TOKENS = 8


def _template_messages(messages: list[dict]) -> list[dict]:
    return [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
             [p if p["type"] == "text" else {"type": "image"} for p in m["content"]]} for m in messages]


def _processor_inputs(processor, messages: list[dict]) -> tuple[dict, list]:
    images = [Image.open(io.BytesIO(b)).convert("RGB") for b in images_of(messages)]
    text = processor.apply_chat_template(_template_messages(messages), add_generation_prompt=True, tokenize=False)
    return processor(text=text, images=images or None, return_tensors="pt", **KWARGS), images


def test_the_crop_count_is_the_image_processors(gemma3_model):
    from transformers import AutoImageProcessor

    cut = AutoImageProcessor.from_pretrained(gemma3_model).pan_and_scan  # the checkpoint's backend
    rng = random.Random(0)
    sizes = [(w, h) for w, h in itertools.product([1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 100, 255, 256, 257,
                                                   511, 640, 1023, 1920], repeat=2)]
    sizes += [(rng.randint(1, 4000), rng.randint(1, 4000)) for _ in range(300)]
    settings = [PanAndScan(), PanAndScan(16, 4, 1.2), PanAndScan(1, 2, 1.0), PanAndScan(64, 8, 1.5),
                PanAndScan(100, 3, 2.0), PanAndScan(7, 1, 0.5)]
    counted = set()
    for pas, (w, h) in itertools.product(settings, sizes):
        want = len(cut(torch.empty(0, h, w), pas.min_crop_size, pas.max_num_crops, pas.min_ratio_to_activate))
        assert pas.num_crops(w, h) == want, (pas, w, h)
        counted.add(want)
    assert counted >= {0, 1, 2, 3, 4, 8}, counted


def test_settings_come_from_the_file_and_the_flags_and_bad_ones_are_named(gemma3_model, tmp_path):
    assert Gemma3Geometry.from_pretrained(gemma3_model).pan_and_scan is None  # off in the file
    assert Gemma3Geometry.from_pretrained(gemma3_model, KWARGS).pan_and_scan == PanAndScan(16, 4, 1.2)
    copy = shutil.copytree(gemma3_model, tmp_path / "pas")
    pre = json.loads((copy / "preprocessor_config.json").read_text())
    (copy / "preprocessor_config.json").write_text(json.dumps(dict(pre, do_pan_and_scan=True,
                                                                   pan_and_scan_max_num_crops=3)))
    geometry = Gemma3Geometry.from_pretrained(copy)
    assert geometry.pan_and_scan == PanAndScan(256, 3, 1.2)
    assert geometry.image_runs(1024, 256) == (16,) * 4 and geometry.num_image_tokens(1024, 256) == 64
    assert geometry.patches(1024, 256) == 4 * 64 and geometry.image_runs(300, 256) == (16,)  # too square
    assert Gemma3Geometry.from_pretrained(copy, {"do_pan_and_scan": False}).num_image_tokens(1024, 256) == 16
    for bad, named in [({"pan_and_scan_min_crop_size": 0}, "pan_and_scan_min_crop_size"),
                       ({"pan_and_scan_max_num_crops": 2.5}, "pan_and_scan_max_num_crops"),
                       ({"pan_and_scan_min_ratio_to_activate": -1}, "pan_and_scan_min_ratio_to_activate"),
                       ({"do_pan_and_scan": "yes"}, "do_pan_and_scan"), ({"size": 32}, "size")]:
        with pytest.raises(ValueError, match=named):
            Gemma3Geometry.from_pretrained(gemma3_model, bad)
    (copy / "preprocessor_config.json").write_text(json.dumps(dict(pre, pan_and_scan_max_num_crops=0)))
    with pytest.raises(ValueError, match="preprocessor_config.json: pan_and_scan_max_num_crops"):
        Gemma3Geometry.from_pretrained(copy)


@pytest.mark.parametrize("index", [1, 2, 7])  # one image; two (4 crops and none); two (2 crops each)
def test_prompt_is_the_processors(gemma3_model, gemma3_reference, index):
    from transformers import AutoTokenizer

    _, processor = gemma3_reference
    messages = MIXED_BATCH[index]
    want, images = _processor_inputs(processor, messages)
    geometry = Gemma3Geometry.from_pretrained(gemma3_model, KWARGS)
    builder = PromptBuilder(AutoTokenizer.from_pretrained(gemma3_model), geometry,
                            processor.tokenizer.image_token_id, prompt_format=GEMMA3_FORMAT)
    refs = [ImageRef(im.width, im.height, f"{i:064x}") for i, im in enumerate(images)]
    prompt = builder.build(_template_messages(messages), refs)
    assert prompt.token_ids == want["input_ids"][0].tolist()
    assert "here are some crops" in processor.tokenizer.decode(prompt.token_ids)
    flags = want["token_type_ids"][0].tolist()  # transformers' image groups: each run its own
    runs = [(i, len(list(g))) for i, (k, g) in _groups(flags) if k]
    assert [(s.offset, s.length) for s in prompt.mm_spans] == runs
    num_crops = processor.image_processor(images, **ALL_KWARGS)["num_crops"]
    assert [(s.mm_hash, s.first_row) for s in prompt.mm_spans] == [
        (ref.mm_hash, 16 * k) for ref, n in zip(refs, num_crops) for k in range(1 + n)]


def _groups(flags: list[int]):
    start = 0
    for key, group in itertools.groupby(flags):
        group = list(group)
        yield start, (key, group)
        start += len(group)


def test_embeddings_are_the_original_then_each_crop(gemma3_model, gemma3_reference):
    from transformers import AutoConfig

    model, processor = gemma3_reference
    vision = load_vision(gemma3_model, AutoConfig.from_pretrained(gemma3_model), torch.float32,
                         processor_kwargs=KWARGS)
    pixels, metas = vision.preprocess(IMAGES)
    want = processor.image_processor(IMAGES, return_tensors="pt", **ALL_KWARGS)
    assert [m.get("num_crops", 0) for m in metas] == want["num_crops"].tolist() == [2, 4, 0, 2]
    torch.testing.assert_close(pixels, want["pixel_values"], rtol=0, atol=0)
    with torch.no_grad():
        entries = vision.forward(pixels, metas)
        ref = model.model.get_image_features(want["pixel_values"]).pooler_output  # [12, 16, hidden]
    assert [tuple(e.embeddings.shape) for e in entries] == [(48, 64), (80, 64), (16, 64), (48, 64)]
    torch.testing.assert_close(torch.cat([e.embeddings for e in entries]), ref.flatten(0, 1), rtol=1e-5, atol=1e-5)
    assert vision.patches(37, 150) == 5 * 64


@torch.no_grad()
def _reference(model, processor, messages: list[dict]) -> tuple[list[int], list[list[int]], torch.Tensor]:
    """transformers' greedy (tokens, top-5 ids per token, their logprobs [NUM_TOKENS, 5])."""
    inputs, _ = _processor_inputs(processor, messages)
    out = model.generate(**inputs, max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)  # [NUM_TOKENS, vocab]
    top = logprobs.topk(5)
    return out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), top.indices.tolist(), top.values


def test_the_llm_with_pan_and_scan_equals_transformers(gemma3_model, gemma3_reference):
    from epd import LLM

    model, processor = gemma3_reference
    batch = [MIXED_BATCH[i] for i in (0, 1, 2, 6, 7)]  # text; one image; two; one too square; two
    expected = [_reference(model, processor, c) for c in batch]
    llm = LLM(gemma3_model, max_num_batched_tokens=40, max_num_seqs=8, dtype="float32", mm_processor_kwargs=KWARGS)
    greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.chat(batch, greedy)
    hits = llm.stats()["prefix_cache_hits"]
    outs += llm.chat([batch[2]], greedy)  # again: its KV from the prefix cache, past its images' runs
    expected.append(expected[2])
    image_token = llm.engine.info.image_token_id
    assert llm.stats()["prefix_cache_hits"] - hits >= max(
        i for i, t in enumerate(outs[-1].prompt_token_ids) if t == image_token) + 1
    assert_greedy_matches(outs, expected)
    assert len(outs[2].prompt_token_ids) > 40 + 80, "two images' runs were meant to span several chunks"
