"""Reading images: the header only (API process) or full pixels (encoder).

Every failure is an `ImageError` with a message fit for a client: not an
image, truncated, too many pixels. Pillow's own decompression-bomb guard is
replaced by an explicit `max_pixels` check on the header, before decoding.
"""
from __future__ import annotations

import io
import warnings

from PIL import Image

Image.MAX_IMAGE_PIXELS = None  # we check sizes ourselves, from the header

DEFAULT_MAX_IMAGE_PIXELS = 64_000_000


class ImageError(ValueError):
    """The bytes are not a usable image."""


def read_image_size(data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> tuple[int, int]:
    """(width, height) from the header alone; no pixel is decoded."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            fmt = img.format
    except Exception as exc:  # PIL raises many types for bad input
        raise ImageError(f"cannot identify image: {exc.__class__.__name__}") from None
    if width < 1 or height < 1:
        raise ImageError(f"{fmt} image has an empty dimension ({width}x{height})")
    if width * height > max_pixels:
        raise ImageError(f"image of {width}x{height} pixels exceeds the limit of {max_pixels} pixels")
    return width, height


def load_image(data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """Decodes the whole image, refusing bombs and truncated files, and hands it
    on as Pillow loaded it, as transformers' processors get it from a user: the
    processor makes it RGB its own way (transparency composited onto white,
    16-bit values converted as Pillow converts them, EXIF orientation not
    applied: the same in vLLM). Converting here first (`convert("RGB")` drops
    alpha) gave other pixels for every image with transparency."""
    read_image_size(data, max_pixels)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. truncated-file warnings become errors
            img = Image.open(io.BytesIO(data))
            img.load()
        return img
    except ImageError:
        raise
    except Exception as exc:
        raise ImageError(f"cannot decode image: {exc}") from None
