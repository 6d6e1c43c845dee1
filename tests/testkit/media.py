"""Test images made locally: random pixels, real PNG/JPEG bytes."""
from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image


def image_bytes(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data)}}


def costly_image(seed: int, size: int = 2000) -> bytes:
    """A PNG of a few KiB that decodes to `size`² pixels: cheap for the API (it reads
    the header), a few hundred ms for the encoder (decode and resize); distinct per seed."""
    pixels = np.zeros((size, size, 3), np.uint8)
    pixels[::97, ::89] = 255
    pixels[:32, :32] = np.random.default_rng(seed).integers(0, 256, (32, 32, 3))
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def describe(image: bytes) -> list[dict]:
    """One user turn: the image, then "Describe it."."""
    return [{"role": "user", "content": [image_part(image), {"type": "text", "text": "Describe it."}]}]


IMG_A = image_bytes(100, 60, seed=1)
IMG_B = image_bytes(37, 150, seed=2, fmt="JPEG")
# name -> (messages, images in order): the chats every serving test compares with transformers
CHATS = {
    "text_only": ([{"role": "user", "content": "Tell me about the red chair."}], []),
    "one_image": ([{"role": "user", "content": [image_part(IMG_A), {"type": "text", "text": "Describe it."}]}],
                  [IMG_A]),
    "two_images": ([{"role": "user", "content": [image_part(IMG_A), image_part(IMG_B),
                                                 {"type": "text", "text": "Compare them."}]}], [IMG_A, IMG_B]),
    "multi_turn": ([{"role": "system", "content": "You are terse."},
                    {"role": "user", "content": [image_part(IMG_B), {"type": "text", "text": "What is it?"}]},
                    {"role": "assistant", "content": "Noise."},
                    {"role": "user", "content": [{"type": "text", "text": "And this?"}, image_part(IMG_A)]}],
                   [IMG_B, IMG_A]),
}


# The 8-request mixed batch the engine tests run under KV pressure: text, one and
# two images of odd aspect ratios, text around images, a system turn.
BATCH_IMAGES = [image_bytes(w, h, seed=s) for s, (w, h) in enumerate([(100, 60), (37, 150), (64, 64), (200, 90)])]


def _text(t: str) -> dict:
    return {"type": "text", "text": t}


MIXED_BATCH = [
    [{"role": "user", "content": "Hello there, how are you today?"}],
    [{"role": "user", "content": [image_part(BATCH_IMAGES[0]), _text("Describe it.")]}],
    [{"role": "user", "content": [image_part(BATCH_IMAGES[1]), image_part(BATCH_IMAGES[2]), _text("Compare them.")]}],
    [{"role": "user", "content": "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20, continue."}],
    [{"role": "user", "content": [_text("First this"), image_part(BATCH_IMAGES[3]), _text("then that.")]}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": [image_part(BATCH_IMAGES[2]), _text("A short question?")]}],
    [{"role": "user", "content": [image_part(BATCH_IMAGES[3]), image_part(BATCH_IMAGES[0]),
                                  _text("Two images, long prompt with several words.")]}],
]


def images_of(messages: list[dict]) -> list[bytes]:
    """The raw bytes of a MIXED_BATCH conversation's images, in order."""
    lookup = {image_part(b)["image_url"]["url"]: b for b in BATCH_IMAGES}
    return [lookup[p["image_url"]["url"]] for m in messages if not isinstance(m["content"], str)
            for p in m["content"] if p["type"] == "image_url"]
