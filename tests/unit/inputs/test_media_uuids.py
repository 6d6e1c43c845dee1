"""ImagesByUuid: the latest bytes under each uuid, least recently used out first."""
from __future__ import annotations

from epd.inputs.media_uuids import ImagesByUuid


def test_latest_bytes_per_uuid_within_count_and_bytes():
    images = ImagesByUuid(max_images=2, max_bytes=10)
    images.put("a", b"1234")
    images.put("b", b"56")
    images.put("a", b"xy")  # replaced, not added
    assert (images.get("a"), images.get("b"), images.num_bytes) == (b"xy", b"56", 4)
    images.get("a")  # a used last: b goes first
    images.put("c", b"7")
    assert (images.get("b"), images.get("a"), images.get("c")) == (None, b"xy", b"7")
    images.put("d", b"123456789")  # three images: the least recently used (a) goes; 10 bytes fit
    assert (images.get("a"), images.get("c"), images.get("d"), images.num_bytes) == (None, b"7", b"123456789", 10)
    images.put("e", b"12")  # 12 bytes: c (then d) go until the budget holds
    assert (images.get("c"), images.get("d"), images.get("e"), images.num_bytes) == (None, None, b"12", 2)
    images.put("f", b"x" * 11)  # larger than the whole budget: not kept
    assert images.get("f") is None and images.num_bytes == 2
