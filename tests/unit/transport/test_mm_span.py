"""An item's span on the wire: offset, length, content key and the family's metadata,
whose shape and types the wire checks and whose keys it never reads."""
import pytest

from epd.transport.wire.mm_span import MAX_META_INTS, MAX_META_KEYS, MMSpan, meta_from_wire, meta_to_wire

HASH = "ab" * 32


def test_a_span_round_trips_with_any_family_metadata():
    span = MMSpan(3, 16, HASH, {"grid": (1, 8, 8), "step": 0.5, "first": 2, "crops": ()})
    assert span.to_list() == [3, 16, HASH, {"grid": [1, 8, 8], "step": 0.5, "first": 2, "crops": []}]
    assert MMSpan.from_list(span.to_list()) == span and span.end == 19
    assert MMSpan.from_list([0, 1, HASH, {}]) == MMSpan(0, 1, HASH)  # a family with no metadata


def test_a_later_run_of_an_item_carries_its_first_row():
    span = MMSpan(40, 16, HASH, {"num_crops": 2}, first_row=32)  # the item's third run
    assert span.to_list() == [40, 16, HASH, {"num_crops": 2}, 32]
    assert MMSpan.from_list(span.to_list()) == span
    for bad in (0, -16, 1.5, "32", None):  # 0 is sent as no fifth item
        with pytest.raises(ValueError, match="bad mm span"):
            MMSpan.from_list([40, 16, HASH, {}, bad])
    with pytest.raises(ValueError, match="bad mm span"):
        MMSpan.from_list([40, 16, HASH, {}, 32, 0])


@pytest.mark.parametrize("meta", [
    [1, 8, 8],                                         # not a map
    {"grid": [1, 8.0, 8]},                             # a list holds ints only
    {"grid": [[1, 8], 8]},
    {"flag": True},                                    # no bools
    {"name": "qwen"},                                  # no strings
    {"step": float("nan")}, {"step": float("-inf")},   # floats are finite
    {"": 1}, {"k" * 65: 1}, {7: 1},                    # keys: 1 to 64 chars
    {f"k{i}": i for i in range(MAX_META_KEYS + 1)},
    {"grid": list(range(MAX_META_INTS + 1))},
    {"nested": {"a": 1}},
])
def test_metadata_of_a_wrong_shape_or_type_is_refused(meta):
    with pytest.raises(ValueError, match="bad item metadata"):
        meta_from_wire(meta)
    with pytest.raises(ValueError, match="bad mm span"):
        MMSpan.from_list([0, 4, HASH, meta])


def test_metadata_at_its_bounds_is_kept():
    meta = {f"k{i}": i for i in range(MAX_META_KEYS - 1)} | {"grid": list(range(MAX_META_INTS))}
    assert meta_to_wire(meta_from_wire(meta)) == meta


@pytest.mark.parametrize("item", [[0, 4, HASH], [0, 4, HASH, {}, 0.5], [0.0, 4, HASH, {}], [0, 4, 7, {}], "span"])
def test_a_span_of_another_form_is_refused(item):
    with pytest.raises(ValueError, match="bad mm span"):
        MMSpan.from_list(item)
