"""An entry's named extras (MMEntry.extras): a row per embedding row, in the
cache's bytes and inside EncodeDone, with their names and order kept."""
import msgpack
import pytest
import torch

from epd.transport.embedding_cache.mm_entry import MMEntry, decode_entry, encode_entry
from epd.transport.wire.messages import EncodeDone, WireError, decode_message

HASH = "ab" * 32


def _entry() -> MMEntry:
    return MMEntry(torch.randn(4, 8), {"b": torch.randn(4, 8), "a": torch.randn(4, 2, 3).half()}, {"grid": (1, 4, 4)})


def test_extras_keep_their_names_order_and_values_in_the_cache_and_on_the_wire():
    e = _entry()
    back = decode_entry(encode_entry(e, "fp"), "fp")
    done = decode_message(EncodeDone("r", HASH, True, None, e.embeddings, e.extras, e.meta).to_wire())
    for got in (back, done):
        assert list(got.extras) == ["b", "a"] and got.meta == {"grid": (1, 4, 4)}
        assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(got.extras.values(), e.extras.values()))


def test_an_extra_without_a_row_per_embedding_row_is_refused():
    e = _entry()
    e.extras["c"] = torch.randn(3, 8)
    with pytest.raises(ValueError, match="a row per embedding row"):
        encode_entry(e, "fp")
    with pytest.raises(WireError, match="a row per embedding row"):
        decode_message(EncodeDone("r", HASH, True, None, e.embeddings, e.extras, e.meta).to_wire())


def test_extras_names_must_match_the_frames():
    frames = [bytes(f) for f in EncodeDone("r", HASH, True, None, torch.randn(4, 8), {"x": torch.randn(4, 8)}).to_wire()]
    for names in ([], ["x", "y"], ["x", 1]):
        header = msgpack.unpackb(frames[0])
        header["extras"] = names
        with pytest.raises(WireError):
            decode_message([msgpack.packb(header), *frames[1:]])
    with pytest.raises(ValueError, match="extras without embeddings"):
        EncodeDone("r", HASH, True, None, None, {"x": torch.randn(4, 8)}).to_wire()
