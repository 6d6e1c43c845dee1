"""The encoder decodes within a memory budget: a batch closes before its
full-resolution pixels pass `max_decoded_pixels`, and the embeddings are the
same as in one batch."""
from __future__ import annotations

import pytest
import torch
from testkit.media import image_bytes


@pytest.fixture(scope="module")
def encoder(tiny_model):
    from epd import LLM

    return LLM(tiny_model, num_kv_blocks=16, dtype="float32", device="cpu").encoder


def test_batches_close_at_the_decoded_pixel_budget(encoder, monkeypatch):
    images = [image_bytes(200, 100, seed=i) for i in range(3)]  # 20,000 pixels each
    together = encoder.encode(images)
    batches: list[int] = []

    def on_batch(num_images: int, preprocess_s: float, forward_s: float) -> None:
        assert preprocess_s > 0 and forward_s > 0
        batches.append(num_images)

    monkeypatch.setattr(encoder, "max_decoded_pixels", 45_000)  # two images' worth
    apart = encoder.encode(images, on_batch=on_batch)
    assert batches == [2, 1]
    monkeypatch.setattr(encoder, "max_decoded_pixels", 1)  # smaller than any image: each alone
    batches.clear()
    alone = encoder.encode(images, on_batch=on_batch)
    assert batches == [1, 1, 1]
    for a, b, c in zip(together, apart, alone):
        assert a.meta["grid_thw"] == b.meta["grid_thw"] == c.meta["grid_thw"]
        torch.testing.assert_close(a.embeddings, b.embeddings, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.embeddings, c.embeddings, rtol=1e-5, atol=1e-5)
