"""The front door stays a front door: README.md is short, docs/README.md lists every
page of docs/ (the decision records' index and the benchmarks' archive among them),
every relative link in README.md, docs/ and docs/decisions/ leads to a file, and the
user pages name only repository paths that exist."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
MAX_README_LINES = 200
USER_PAGES = ("usage", "deployment", "openai_api")  # docs/ pages written for users, besides the generated flags.md
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")  # [text](path) or [text](path#anchor)


def test_the_readme_is_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines: move the detail to a page under docs/"


def test_the_docs_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text()
    listed = set(LINK.findall(index))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    pages |= {"decisions/README.md"}  # the records are reached through their own index
    assert pages <= listed, f"docs/README.md does not list {sorted(pages - listed)}"


def test_every_relative_link_leads_to_a_file():
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
                 *sorted((ROOT / "docs" / "decisions").glob("*.md"))]:
        for target in LINK.findall(page.read_text()):
            if "://" not in target and not target.startswith("mailto:") and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_every_repository_path_the_user_pages_name_exists():
    """The pages a user reads (README.md and the guides) name real files: a module moved
    without its page fails here (architecture.md and design.md: test_docs.py)."""
    top = "|".join(("epd", "engine", "transport", "encoders", "bench", "tests", "docs", "scripts", "deploy"))
    missing = []
    for page in [ROOT / "README.md", *(ROOT / "docs" / f"{name}.md" for name in USER_PAGES)]:
        for path in set(re.findall(rf"\b((?:{top})/[\w/.-]*\w)", page.read_text())):
            if not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, sorted(missing)
