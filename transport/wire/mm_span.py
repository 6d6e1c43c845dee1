"""One image's (or video's) placeholder run inside a prompt: the span every layer shares.

The API builds spans from the prompt, they travel inside PrefillRequest and
KVTransfer, and the engine's scheduler, block manager and runner read them.
Pure Python (no torch), so the scheduler stays torch-free.

The wire knows no model family: what a family needs of an item beyond where
it sits and its content key (its vision grid, how its positions are spaced)
rides in `meta`, a small mapping of plain values the family writes and reads
(docs/decisions/model-agnostic-wire.md). The wire checks its shape, never
its keys.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Union

MetaValue = Union[int, float, tuple[int, ...]]
MAX_META_KEYS = 16  # keys one item's metadata may hold
MAX_META_INTS = 64  # ints one list value may hold
_MAX_KEY_CHARS = 64


@dataclass(frozen=True)
class MMSpan:
    """`length` placeholder tokens of item `mm_hash`, starting at prompt token `offset`.

    `offset` is the index of the item's first placeholder token in the prompt,
    `length` the number of placeholder tokens (= the rows of the item's embeddings it takes),
    `meta` the model family's metadata of the item: names to ints, floats or
    tuples of ints (what each name means is the family's position rule).
    An item written as several runs of placeholders with text between them
    (an image and its crops) has a span per run, all with its `mm_hash`:
    `first_row` is the entry's row of the run's first token (0: the item's
    first run, or its only one), so the run takes rows first_row..+length.
    Sent as `[offset, length, mm_hash, meta]`, with `first_row` fifth when not 0.
    """

    offset: int
    length: int
    mm_hash: str
    meta: Mapping[str, MetaValue] = field(default_factory=dict)
    first_row: int = 0

    @property
    def end(self) -> int:
        return self.offset + self.length

    def to_list(self) -> list:
        item = [self.offset, self.length, self.mm_hash, meta_to_wire(self.meta)]
        return item + [self.first_row] if self.first_row else item

    @staticmethod
    def from_list(item: Any) -> MMSpan:
        """The inverse of `to_list`; ValueError for anything else."""
        if not (isinstance(item, list) and len(item) in (4, 5) and type(item[0]) is int
                and type(item[1]) is int and type(item[2]) is str
                and (len(item) == 4 or (type(item[4]) is int and item[4] > 0))):
            raise ValueError(f"bad mm span {item!r:.80}")
        try:
            return MMSpan(item[0], item[1], item[2], meta_from_wire(item[3]), *item[4:])
        except ValueError as e:
            raise ValueError(f"bad mm span {item[:3]!r:.80}: {e}") from None


def meta_to_wire(meta: Mapping[str, MetaValue]) -> dict:
    """An item's metadata as msgpack values (tuples as lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in meta.items()}


def meta_from_wire(value: Any) -> dict[str, MetaValue]:
    """The inverse of `meta_to_wire`: a map of at most MAX_META_KEYS names to ints,
    finite floats or lists of at most MAX_META_INTS ints (returned as tuples);
    ValueError for anything else."""
    if not (isinstance(value, dict) and len(value) <= MAX_META_KEYS):
        raise ValueError(f"bad item metadata {value!r:.80}: a map of at most {MAX_META_KEYS} entries")
    meta: dict[str, MetaValue] = {}
    for key, v in value.items():
        if not (type(key) is str and 0 < len(key) <= _MAX_KEY_CHARS):
            raise ValueError(f"bad item metadata key {key!r:.80}")
        if type(v) is int or (type(v) is float and math.isfinite(v)):
            meta[key] = v
        elif isinstance(v, list) and len(v) <= MAX_META_INTS and all(type(x) is int for x in v):
            meta[key] = tuple(v)
        else:
            raise ValueError(f"bad item metadata {key}={v!r:.80}: an int, a finite float or a list of ints")
    return meta
