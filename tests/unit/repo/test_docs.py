"""The docs name real files: every repository path that docs/architecture.md,
docs/design.md, the decision records and docs/benchmarks.md mention exists
(the archive of earlier benchmarks is history and may name what has since
moved), every section the code cites by title (`docs/<doc>.md, "Title"`) is
still there, and nothing in the repository cites a design document outside it."""
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
    ("benchmarks.md", 2),  # the current results' commands name their scripts
])
def test_every_path_in_the_doc_exists(doc, min_paths):
    paths = _paths((ROOT / "docs" / doc).read_text())
    assert len(paths) > min_paths
    missing = sorted(p for p in paths if not (ROOT / p).exists() and not _module_symbol_exists(p))
    assert not missing, missing


def test_every_path_in_the_decision_records_exists():
    records = sorted((ROOT / "docs" / "decisions").glob("*.md"))
    assert len(records) > 20
    missing = sorted(f"{r.name}: {p}" for r in records for p in _paths(r.read_text())
                     if not (ROOT / p).exists() and not _module_symbol_exists(p))
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


# a module name in lower case (`bench.dev.NAME` is a placeholder)
MODULE_COMMAND = re.compile(r"python3? (?:-\w+ )*-m ((?:bench\.dev|epd)(?:\.[a-z_]\w*)+)(?!\w|\.\w)")
# installed name -> repository folder (pyproject's package-dir mapping)
FOLDERS = {"epd.engine": "engine", "epd.transport": "transport", "epd.encoders": "encoders", "epd.bench": "bench",
           "bench.dev": "bench/dev", "epd": "epd"}


def test_every_python_m_command_names_a_module():
    """A `python -m bench.dev.vs_vllm` or `python -m epd.cli.flags_reference` in a doc, a
    script or a docstring runs a module of the checkout (the archive of benchmarks aside)."""
    files = subprocess.run(["git", "ls-files", "*.md", "*.py", "*.sh"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    named = {(f, m.group(1)) for f in files if f != "docs/benchmarks_archive.md" and (ROOT / f).is_file()
             for m in MODULE_COMMAND.finditer((ROOT / f).read_text(errors="replace"))}
    assert any(module.startswith("bench.dev.") for _, module in named)
    missing = sorted(f"{f}: {module}" for f, module in named if not _module_file(module))
    assert not missing, missing


def _module_file(module: str) -> bool:
    package = max((p for p in FOLDERS if module == p or module.startswith(p + ".")), key=len)
    path = ROOT / FOLDERS[package] / module[len(package):].lstrip(".").replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()


CITATION = re.compile(r'(docs/[\w/]+\.md),\s*"([^"]+)"')


def test_every_section_the_code_cites_is_there():
    """A docstring's `(docs/architecture.md, "Faults")` names a heading or a bold paragraph
    lead (`* **Title.**`) of that doc; a section moved to a record leaves no dangling pointer."""
    sources = [p for top in TOP if top != "docs" for p in (ROOT / top).rglob("*.py")]
    cited = {(m.group(1), m.group(2)) for p in sources
             for m in CITATION.finditer(re.sub(r"\s*\n\s*#?\s*", " ", p.read_text(errors="replace")))}
    assert len(cited) > 5
    missing = sorted(f"{doc}: {title}" for doc, title in cited if not _has_section(doc, title))
    assert not missing, missing


def _has_section(doc: str, title: str) -> bool:
    path = ROOT / doc
    if not path.exists():
        return False
    text = path.read_text()
    titles = re.findall(r"^#+\s*(.+)$", text, re.M) + re.findall(r"\*\*([^*]+)\*\*", text)
    want = _plain(title)
    return any(_plain(t).startswith(want) for t in titles)


def _plain(text: str) -> str:
    return re.sub(r"[`*]", "", text).replace("→", "->").strip().rstrip(".:").lower()


def _paths(text: str) -> set[str]:
    return set(re.findall(r"\b((?:%s)/[\w/.-]*\w)" % "|".join(TOP), text))


def _module_symbol_exists(path: str) -> bool:
    """"transport/embedding_cache/mm_cache.MMCache": the module file, and the name defined in it."""
    module, _, symbol = path.rpartition("/")[2].partition(".")
    source = ROOT / path.rpartition("/")[0] / f"{module}.py"
    return bool(symbol) and source.exists() and re.search(rf"\b(def|class) {symbol}\b|^{symbol} =",
                                                          source.read_text(), re.M) is not None
