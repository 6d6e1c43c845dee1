"""The placeholder count from width and height alone equals what the
checkpoint's image processor produces after decoding and resizing."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from epd.encoders.image_io import ImageError, load_image, read_image_size
from epd.transport.media.image_geometry import ImageGeometry
from epd.families.qwen_vl.image_processor import ImagePreprocessor

SIZES = [(1, 1), (2, 3), (16, 16), (31, 33), (32, 32), (100, 60), (37, 150), (224, 224), (448, 448),
         (640, 480), (1920, 1080), (4000, 3000), (5000, 25), (25, 5000), (199, 1), (1, 199),
         (10000, 60), (3, 600)]


@pytest.fixture(scope="module")
def preprocessor(tiny_model):
    return ImagePreprocessor(tiny_model)


@pytest.mark.parametrize("width,height", SIZES)
def test_num_image_tokens_matches_processor(preprocessor, width, height):
    img = Image.fromarray(np.zeros((height, width, 3), dtype=np.uint8))
    _, grids = preprocessor([img])
    t, h, w = grids[0]
    geometry = preprocessor.geometry
    assert geometry.grid_thw(width, height) == (t, h, w)
    assert geometry.num_image_tokens(width, height) == t * h * w // geometry.merge_size ** 2


@pytest.mark.parametrize("min_pixels,max_pixels", [(56 * 56, 28 * 28 * 1280), (65536, 16777216)])
def test_sweep_other_pixel_limits(min_pixels, max_pixels):
    """The same rule under the published Qwen3-VL limits, against transformers' smart_resize."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    geometry = ImageGeometry(patch_size=16, merge_size=2, temporal_patch_size=2,
                             min_pixels=min_pixels, max_pixels=max_pixels)
    rng = np.random.default_rng(0)
    for _ in range(2000):
        w, h = (int(v) for v in rng.integers(1, 12000, size=2))
        if max(w, h) / min(w, h) > 200:
            continue
        rh, rw = smart_resize(h, w, factor=32, min_pixels=min_pixels, max_pixels=max_pixels)
        assert geometry.resized_size(w, h) == (rw, rh)


def test_extreme_aspect_ratio_is_refused():
    geometry = ImageGeometry(16, 2, 2, 1024, 65536)
    with pytest.raises(ValueError, match="aspect ratio"):
        geometry.num_image_tokens(201, 1)


def test_header_only_size_and_bad_bytes():
    from testkit.media import image_bytes

    data = image_bytes(123, 45, fmt="JPEG")
    assert read_image_size(data) == (123, 45)
    with pytest.raises(ImageError, match="cannot identify"):
        read_image_size(b"definitely not an image")
    with pytest.raises(ImageError, match="exceeds the limit"):
        read_image_size(data, max_pixels=100)
    with pytest.raises(ImageError):
        load_image(data[: len(data) // 2])  # truncated
