"""The docs name real files: every repository path that docs/architecture.md
and docs/design.md mention exists, and nothing in the repository cites a
design document outside it."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
TOP = ("epd", "engine", "transport", "encoders", "bench", "tests", "docs", "scripts")


@pytest.mark.parametrize("doc, min_paths", [
    ("architecture.md", 30),  # the doc maps the request's life to files
    ("design.md", 15),  # the contract names the modules that keep it
])
def test_every_path_in_the_doc_exists(doc, min_paths):
    text = (ROOT / "docs" / doc).read_text()
    paths = set(re.findall(r"\b((?:%s)/[\w/.-]*\w)" % "|".join(TOP), text))
    assert len(paths) > min_paths
    missing = sorted(p for p in paths if not (ROOT / p).exists() and not _module_symbol_exists(p))
    assert not missing, missing


def test_the_docs_link_each_other():
    for doc, other in (("architecture.md", "design.md"), ("design.md", "architecture.md")):
        assert f"]({other})" in (ROOT / "docs" / doc).read_text(), (doc, other)


def test_nothing_cites_a_design_document_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    citing = [f for f in files if (ROOT / f).is_file() and f != "tests/unit/repo/test_docs.py"
              and re.search(r"shared/DESIGN\.md|\bDESIGN\.md", (ROOT / f).read_text(errors="replace"))]
    assert not citing, citing


def _module_symbol_exists(path: str) -> bool:
    """"transport/embedding_cache/mm_cache.MMCache": the module file, and the name defined in it."""
    module, _, symbol = path.rpartition("/")[2].partition(".")
    source = ROOT / path.rpartition("/")[0] / f"{module}.py"
    return bool(symbol) and source.exists() and re.search(rf"\b(def|class) {symbol}\b|^{symbol} =",
                                                          source.read_text(), re.M) is not None
