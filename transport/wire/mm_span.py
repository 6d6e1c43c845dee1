"""One image's (or video's) placeholder run inside a prompt: the span every layer shares.

The API builds spans from the prompt, they travel inside PrefillRequest and
KVTransfer, and the engine's scheduler, block manager and runner read them.
Pure Python (no torch), so the scheduler stays torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MMSpan:
    """`length` placeholder tokens of image `mm_hash`, starting at prompt token `offset`.

    `offset` is the index of the first `<|image_pad|>` token in the prompt,
    `length` the number of placeholder tokens (= merged vision tokens),
    `grid_thw` the vision grid in patches (t, h, w) before the spatial merge.
    `second_per_grid_t`: a Qwen2.5-VL video's seconds per temporal group, which
    spaces its M-RoPE temporal positions (x tokens_per_second); 0 for images
    and Qwen3-VL video groups (temporal position = group index). Sent only when set.
    `first_group`: a chunk of a Qwen2.5-VL video cut into several spans
    (`--video-chunk-frames`) that continues the span before it: its temporal
    groups are the video's from `first_group` on, placed as in one span
    (engine/models/mrope.py). 0 for any other span; a 6th wire item only when set.
    """

    offset: int
    length: int
    mm_hash: str
    grid_thw: tuple[int, int, int]
    second_per_grid_t: float = 0.0
    first_group: int = 0

    @property
    def end(self) -> int:
        return self.offset + self.length

    def to_list(self) -> list:
        out = [self.offset, self.length, self.mm_hash, list(self.grid_thw)]
        if self.first_group:
            return out + [self.second_per_grid_t, self.first_group]
        return out + [self.second_per_grid_t] if self.second_per_grid_t else out

    @staticmethod
    def from_list(item: Any) -> MMSpan:
        """The inverse of `to_list`; ValueError for anything else."""
        if not (isinstance(item, list) and len(item) in (4, 5, 6) and type(item[0]) is int
                and type(item[1]) is int and type(item[2]) is str and _is_grid(item[3])
                and (len(item) == 4 or _is_seconds(item[4]) or (len(item) == 6 and item[4] == 0
                                                                  and type(item[4]) in (int, float)))
                and (len(item) < 6 or (type(item[5]) is int and 0 < item[5] < 1 << 20))):
            raise ValueError(f"bad mm span {item!r:.80}")
        return MMSpan(item[0], item[1], item[2], tuple(item[3]), float(item[4]) if len(item) >= 5 else 0.0,
                      item[5] if len(item) == 6 else 0)


def _is_grid(v: Any) -> bool:
    """[t, h, w]: three non-negative ints."""
    return isinstance(v, list) and len(v) == 3 and all(type(x) is int and x >= 0 for x in v)


def _is_seconds(v: Any) -> bool:
    """A finite positive number of seconds (NaN and infinity fail both comparisons or the bound)."""
    return type(v) in (int, float) and 0 < v < 1e6
