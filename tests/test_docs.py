"""docs/architecture.md names real files: every repository path it mentions exists."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = ("epd", "engine", "transport", "encoders", "bench", "tests", "docs", "scripts")


def test_every_path_in_the_architecture_doc_exists():
    text = (ROOT / "docs" / "architecture.md").read_text()
    paths = set(re.findall(r"\b((?:%s)/[\w/.-]*\w)" % "|".join(TOP), text))
    assert len(paths) > 30  # the doc maps the request's life to files
    missing = sorted(p for p in paths if not (ROOT / p).exists() and not _module_symbol_exists(p))
    assert not missing, missing


def _module_symbol_exists(path: str) -> bool:
    """"transport/mm_cache.MMCache": the module file, and the name defined in it."""
    module, _, symbol = path.rpartition("/")[2].partition(".")
    source = ROOT / path.rpartition("/")[0] / f"{module}.py"
    return bool(symbol) and source.exists() and re.search(rf"\b(def|class) {symbol}\b|^{symbol} =",
                                                          source.read_text(), re.M) is not None
