"""InternVL's torch-free tile geometry against transformers' GotOcr2 image
processor: the tiles it makes (and counts) for many sizes and settings, the
--mm-processor-kwargs it takes, and the prompt text an image becomes."""
from __future__ import annotations

import json

import pytest
from PIL import Image

from epd.families.internvl.prompt_format import INTERNVL_FORMAT, TileGeometry, check_processor_kwargs
from epd.families.internvl.presets import PRESETS, write_processor_configs

SIZES = [(1, 1), (64, 64), (150, 70), (70, 150), (40, 200), (200, 40), (127, 64), (64, 127), (500, 100),
         (33, 31), (448, 448), (1000, 250), (96, 32), (3, 900), (257, 129)]
SETTINGS = [{}, {"max_patches": 12}, {"min_patches": 2, "max_patches": 8}, {"crop_to_patches": False},
            {"max_patches": 1}, {"min_patches": 3, "max_patches": 3}]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = tmp_path_factory.mktemp("internvl_processor")
    write_processor_configs(out, PRESETS["internvl-tiny"])
    (out / "config.json").write_text(json.dumps({"model_type": "internvl", "downsample_ratio": 0.5}))
    return out


@pytest.mark.parametrize("kwargs", SETTINGS, ids=lambda k: json.dumps(k) if k else "files")
def test_tiles_are_the_image_processors(files, kwargs):
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(str(files))
    geometry = TileGeometry.from_pretrained(files, kwargs)
    call = {"crop_to_patches": True, **kwargs}  # InternVLProcessor's default: crop
    for width, height in SIZES:
        image = Image.new("RGB", (width, height), (width % 256, height % 256, 7))
        made = processor(images=[image], return_tensors="pt", **call)
        assert made["pixel_values"].shape[0] == geometry.num_tiles(width, height), (width, height)
        assert processor.get_number_of_image_patches(height, width, call) == geometry.num_tiles(width, height)
        assert geometry.num_image_tokens(width, height) == 16 * geometry.num_tiles(width, height)


def test_the_files_settings_and_the_processor_default(files):
    g = TileGeometry.from_pretrained(files)
    assert (g.tile_size, g.tokens_per_tile, g.crop_to_patches, g.min_patches, g.max_patches) == (64, 16, True, 1, 6)
    assert g.span_meta(150, 70) == {"num_tiles": 3}  # 2x1 tiles + the thumbnail, 8x8 patches each
    assert g.merge_size == 2 and g.patches(150, 70) == 192 and g.num_image_tokens(150, 70) == 48
    assert TileGeometry.from_pretrained(files, {"crop_to_patches": False}).num_tiles(150, 70) == 1


@pytest.mark.parametrize("kwargs, message", [
    ({"max_pixels": 4}, "max_pixels cannot be applied"),
    ({"max_patches": 0}, "max_patches must be a positive integer"),
    ({"min_patches": True}, "min_patches must be a positive integer"),
    ({"crop_to_patches": 1}, "crop_to_patches must be true or false"),
])
def test_processor_kwargs_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        check_processor_kwargs(kwargs)


def test_an_image_becomes_its_tokens_inside_img_and_end():
    assert INTERNVL_FORMAT.expand_image(3) == "<img><IMG_CONTEXT><IMG_CONTEXT><IMG_CONTEXT></img>"

def test_a_video_becomes_its_frames_each_one_tile_labelled():
    """InternVLProcessor.replace_video_token: "Frame{i}: " + a tile's image, frames a newline apart."""
    from epd.transport.media.video_geometry import VideoPlan

    plan = VideoPlan((0, 2), 64, 64, (2, 4, 4), 8, 4, (0.0, 0.4))
    tile = "<img>" + "<IMG_CONTEXT>" * 4 + "</img>"
    assert INTERNVL_FORMAT.expand_video(plan, "<video>") == f"Frame1: {tile}\nFrame2: {tile}"
