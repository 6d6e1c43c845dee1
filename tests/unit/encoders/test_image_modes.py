"""Images in every mode reach the vision tower as transformers' processor sees
them when a user opens the same bytes with Pillow (issue 33, item 10):
transparency composited onto white (converting to RGB first dropped it),
16-bit values and CMYK converted as Pillow converts them, EXIF orientation
not applied (neither transformers' processor nor vLLM applies it)."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor

from epd.encoders.image_io import load_image
from epd.families.qwen_vl.image_processor import ImagePreprocessor


def _encoded(img: Image.Image, fmt: str = "PNG", **options) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **options)
    return buf.getvalue()


def _cases() -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    rgba = rng.integers(0, 256, (48, 64, 4), dtype=np.uint8)
    rgba[:, :20, 3] = 0  # a transparent band: its colour must not show
    rgb = Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8))
    rotated = rgb.getexif()
    rotated[0x0112] = 6  # Orientation: rotate 90 degrees
    return {
        "rgba": _encoded(Image.fromarray(rgba, "RGBA")),
        "la": _encoded(Image.fromarray(rng.integers(0, 256, (48, 64, 2), dtype=np.uint8), "LA")),
        "palette_transparency": _encoded(rgb.convert("P"), transparency=0),
        "gray16": _encoded(Image.fromarray(rng.integers(0, 65536, (48, 64)).astype(np.uint16))),
        "cmyk_jpeg": _encoded(rgb.convert("CMYK"), "JPEG"),
        "exif_rotated_jpeg": _encoded(rgb, "JPEG", exif=rotated.tobytes()),
        "gray": _encoded(rgb.convert("L")),
    }


CASES = _cases()


@pytest.fixture(scope="module")
def processors(tiny_model):
    return ImagePreprocessor(tiny_model), AutoImageProcessor.from_pretrained(tiny_model)


@pytest.mark.parametrize("name", sorted(CASES))
def test_pixels_equal_transformers_processor_on_the_opened_file(processors, name):
    ours, reference = processors
    data = CASES[name]
    pixel_values, grids = ours([load_image(data)])
    expected = reference(images=[Image.open(io.BytesIO(data))], return_tensors="pt")
    assert grids == [tuple(expected["image_grid_thw"][0].tolist())]
    assert torch.equal(pixel_values, expected["pixel_values"])
