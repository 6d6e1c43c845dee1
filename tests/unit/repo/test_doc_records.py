"""The docs' two kinds of record keep their shape: every decision record in
docs/decisions/ is listed in its index and has a title, Context, Decision
and Consequences; docs/benchmarks.md opens with the current-results table,
each row a figure, the command that reproduces it and the date it was
recorded; and neither the pages a user reads nor the installed code cite "issue N"."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DECISIONS = ROOT / "docs" / "decisions"
RECORD_HEADINGS = ["## Context", "## Decision", "## Consequences"]
MAX_RECORD_LINES = 60  # a record is short: the detail belongs in architecture.md's feature sections
COMMAND = re.compile(r"`(?:sudo )?(?:[A-Z_]+=\S+ )*(?:epd|python|bash) [^`]+`")  # a runnable command, in backticks
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
ISSUE = re.compile(r"(?<![-\w])issues? \d+", re.I)  # "issue 26", not a flag's "--issues 44"
USER_PAGES = ["README.md", "docs/README.md", "docs/usage.md", "docs/deployment.md", "docs/openai_api.md",
              "docs/vllm_fields.md", "docs/design.md", "docs/architecture.md", "docs/benchmarks.md"]


def _records() -> list[Path]:
    return sorted(p for p in DECISIONS.glob("*.md") if p.name != "README.md")


def test_every_decision_record_is_listed_in_the_index():
    index = (DECISIONS / "README.md").read_text()
    listed = set(re.findall(r"\]\(([\w.-]+\.md)\)", index))
    records = {p.name for p in _records()}
    assert len(records) > 20  # the glob found the records
    assert records <= listed, f"docs/decisions/README.md does not list {sorted(records - listed)}"
    assert listed <= records | {"README.md"}, f"the index lists missing records {sorted(listed - records)}"


@pytest.mark.parametrize("record", _records(), ids=lambda p: p.stem)
def test_each_record_has_a_title_context_decision_and_consequences(record):
    lines = record.read_text().splitlines()
    assert lines[0].startswith("# ") and len(lines[0]) > 4, f"{record.name}: the first line is its `# Title`"
    headings = [line.strip() for line in lines if line.startswith("## ")]
    assert headings == RECORD_HEADINGS, f"{record.name}: headings {headings}, expected {RECORD_HEADINGS}"
    sections = re.split(r"^## .*$", record.read_text(), flags=re.M)[1:]
    assert all(section.strip() for section in sections), f"{record.name}: an empty section"
    assert len(lines) <= MAX_RECORD_LINES, f"{record.name} has {len(lines)} lines: keep a record short"


def test_benchmarks_opens_with_the_current_results_table():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    first_section = re.search(r"^## (.+)$", text, re.M)
    assert first_section and first_section.group(1) == "Current results", "benchmarks.md's first section"
    section = text[first_section.end():].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    header, separator, body = rows[0], rows[1], rows[2:]
    assert [c.strip() for c in header.strip("|").split("|")] == ["figure", "result", "command", "recorded"]
    assert set(separator) <= set("|-: ")
    assert len(body) >= 20, "the table lost its rows"
    for row in body:
        cells = [c.strip() for c in row.strip("|").split("|")]
        figure, command, recorded = cells[0], " | ".join(cells[2:-1]), cells[-1]
        assert figure, row
        assert COMMAND.search(command), f"no command in the row: {figure}"
        assert DATE.search(recorded), f"no date in the row: {figure}"


def test_the_archive_says_it_is_history():
    opening = (ROOT / "docs" / "benchmarks_archive.md").read_text()[:1000]
    assert "history" in opening and "superseded" in opening and "](benchmarks.md)" in opening


@pytest.mark.parametrize("page", USER_PAGES + [str(p.relative_to(ROOT)) for p in _records()])
def test_no_issue_numbers_in_the_pages_a_user_reads(page):
    cited = [line.strip() for line in (ROOT / page).read_text().splitlines() if ISSUE.search(line)]
    assert not cited, f"{page} cites issues (say what was decided and why instead): {cited}"


def test_no_issue_numbers_in_the_installed_code():
    """What ships (its docstrings, comments, help and error texts) is read by users: it says
    what the code does and why, not which issue asked for it. Tests and bench/dev/ (developer
    experiments, outside the wheel) may keep their provenance."""
    sources = [p for top in ("epd", "engine", "encoders", "transport", "bench", "scripts")
               for p in (ROOT / top).rglob("*") if p.suffix in (".py", ".c", ".sh")
               and "dev" not in p.relative_to(ROOT).parts[1:2]]
    assert len(sources) > 100
    cited = [f"{p.relative_to(ROOT)}:{n}" for p in sources
             for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if ISSUE.search(line)]
    assert not cited, f"say what the code does and why instead: {cited}"
