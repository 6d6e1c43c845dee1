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
