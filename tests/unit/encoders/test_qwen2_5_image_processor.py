"""Qwen2.5-VL's image processor settings (14-pixel patches, CLIP normalisation,
limits as top-level min_pixels / max_pixels the way its checkpoints write
them): the placeholder count from width and height alone equals the
processor's grid, and the pixels are normalised with the checkpoint's mean."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from testkit.family_checkpoints import family_checkpoint
from PIL import Image

from epd.families.qwen_vl.image_processor import ImagePreprocessor

SIZES = [(1, 1), (27, 29), (28, 28), (100, 60), (37, 150), (224, 224), (640, 480), (5000, 25), (3, 600)]


@pytest.fixture(scope="module")
def preprocessor(tmp_path_factory):
    """The test checkpoint with a processor config as published Qwen2.5-VL checkpoints write it."""
    out = tmp_path_factory.mktemp("qwen2_5") / "ckpt"
    shutil.copytree(family_checkpoint("qwen2_5_vl"), out)
    cfg = json.loads((out / "preprocessor_config.json").read_text())
    cfg.pop("size")
    cfg.update(min_pixels=3136, max_pixels=200 * 28 * 28)
    (out / "preprocessor_config.json").write_text(json.dumps(cfg))
    return ImagePreprocessor(out)


@pytest.mark.parametrize("width,height", SIZES)
def test_num_image_tokens_matches_processor(preprocessor, width, height):
    img = Image.fromarray(np.zeros((height, width, 3), dtype=np.uint8))
    pixel_values, grids = preprocessor([img])
    geometry = preprocessor.geometry
    assert geometry.patch_size == 14
    assert geometry.grid_thw(width, height) == grids[0]
    assert pixel_values.shape == (int(np.prod(grids[0])), 3 * 2 * 14 * 14)


def test_pixels_use_the_clip_mean_and_std(preprocessor):
    gray = Image.fromarray(np.full((56, 56, 3), 128, dtype=np.uint8))
    pixel_values, _ = preprocessor([gray])
    per_channel = pixel_values.view(-1, 3, 2 * 14 * 14)[:, :, 0][0]  # [3]: channel values of one patch
    mean, std = torch.tensor([0.48145466, 0.4578275, 0.40821073]), torch.tensor([0.26862954, 0.26130258, 0.27577711])
    torch.testing.assert_close(per_channel, (128 / 255 - mean) / std, atol=1e-4, rtol=0)
