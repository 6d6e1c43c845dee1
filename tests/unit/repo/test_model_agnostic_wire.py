"""The wire and the embedding cache know no model family (docs/decisions/model-agnostic-wire.md):
an item's span is its offset, length, content key and the family's metadata, an entry its
embeddings and named extras. No file of transport/wire or transport/embedding_cache names
a field of Qwen's (its vision grid, Qwen2.5-VL's time step, Qwen3-VL's deepstack features);
the family writes and reads them inside the metadata and the extras."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
FOLDERS = ("transport/wire", "transport/embedding_cache")
FAMILY_FIELDS = re.compile(r"grid_thw|second_per_grid_t|deepstack", re.IGNORECASE)


def test_the_wire_and_the_cache_name_no_family_field():
    files = [p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]
    assert len(files) > 10  # the folders were found
    named = {f"{p.relative_to(ROOT)}:{n}": line.strip() for p in files
             for n, line in enumerate(p.read_text().splitlines(), 1) if FAMILY_FIELDS.search(line)}
    assert named == {}


def test_the_pattern_finds_what_it_looks_for():
    assert all(FAMILY_FIELDS.search(s) for s in ("span.grid_thw", "MMEntry.deepstack", "second_per_grid_t: float"))
