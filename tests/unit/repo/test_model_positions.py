"""Positions are the model's (engine/models/positions.py): no generic engine file
(everything in engine/ outside engine/models/) names M-RoPE or builds a
three-row positions tensor; they ask the model's `positions` instead."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ENGINE = ROOT / "engine"
NAMES_MROPE = re.compile(r"mrope|m-rope", re.IGNORECASE)
THREE_ROWS = re.compile(r"\b(zeros|ones|full|empty|expand)\(\(?3,")
# generic file -> why it may name M-RoPE
ALLOWED = {
    "engine/spec/eagle3_config.py": "rejects an EAGLE-3 head whose Hugging Face rope config has `mrope_section` "
                                    "(a key of the head's config.json, not the target's positions)",
}


def _generic_files():
    for path in sorted(ENGINE.rglob("*.py")):
        if not path.is_relative_to(ENGINE / "models"):
            yield path.relative_to(ROOT).as_posix(), path.read_text()


def test_no_generic_engine_file_names_mrope_or_assumes_three_rows():
    offenders = []
    for name, text in _generic_files():
        for number, line in enumerate(text.splitlines(), 1):
            if (NAMES_MROPE.search(line) and name not in ALLOWED) or THREE_ROWS.search(line):
                offenders.append(f"{name}:{number}: {line.strip()}")
    assert offenders == [], "ask the model's `positions` (engine/models/positions.py):\n" + "\n".join(offenders)


def test_each_allowed_file_still_needs_its_exception():
    texts = dict(_generic_files())
    stale = [name for name in ALLOWED if not NAMES_MROPE.search(texts.get(name, ""))]
    assert stale == [], f"no longer names M-RoPE: drop from ALLOWED {stale}"
