"""bench.dev.greedy_reference builds transformers' inputs for a Qwen3.5 image prompt without its
processor (which needs torchvision): one image pad per merged patch, which transformers' model
takes (it refuses a count that does not match the image's features), and greedy steps with gaps."""
from __future__ import annotations

import torch

from bench.dev.greedy_reference import model_inputs, reference
from epd.bench.datasets import load_tokenizer, sample_random_mm


def test_a_qwen3_5_image_prompt_has_one_pad_per_merged_patch_and_decodes(tmp_path):
    from transformers import AutoModelForImageTextToText

    from epd.tools.make_model import make_model

    ckpt = str(make_model(tmp_path / "q35", "qwen3.5-tiny", seed=0))
    model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32).eval()
    request = sample_random_mm(1, 32, 4, images_per_request=2, image_sizes=[(96, 64)], seed=1,
                               tokenizer=load_tokenizer(ckpt))[0]
    inputs = model_inputs(model, ckpt, request)
    pads = int((inputs["input_ids"] == model.config.image_token_id).sum())
    assert pads == int(inputs["image_grid_thw"].prod(dim=1).sum()) // 4 > 0
    ids, gaps = reference(model, inputs, 4)
    assert len(ids) == len(gaps) == 4 and min(gaps) >= 0.0
