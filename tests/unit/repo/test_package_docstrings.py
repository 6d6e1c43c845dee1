"""Each room says what is in it: a package's __init__.py docstring names every
module of the package (`name.py`) and sub-package (`name/`), and names none
that is gone.

Checked for every package in CHECKED, bench/dev/ (the experiments, not installed) among them.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CHECKED = ("epd", "epd/api", "epd/api/tool_parsers", "epd/cli", "epd/inputs", "epd/tools", "epd/serve", "epd/processes",
           "epd/families", "epd/families/qwen_vl", "epd/families/glm4v", "epd/families/gemma3",
           "engine", "engine/spec", "engine/lora", "engine/models", "engine/layers", "engine/attention",
           "engine/worker",
           "encoders", "encoders/layers", "transport", "transport/wire", "transport/embedding_cache", "transport/weights",
           "transport/media", "transport/host", "bench", "bench/dev")
# a bare `name.py` or `name/`: not a path into another folder (`epd/requests.py`)
NAMED = re.compile(r"(?<![\w/.])(\w+)(\.py\b|/)")


def _contents(package: Path) -> set[str]:
    modules = {f"{p.stem}.py" for p in package.glob("*.py") if p.name != "__init__.py"}
    return modules | {f"{p.name}/" for p in package.iterdir() if (p / "__init__.py").is_file()}


@pytest.mark.parametrize("folder", CHECKED)
def test_the_package_docstring_lists_its_modules(folder):
    package = ROOT / folder
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    named = {name + suffix for name, suffix in NAMED.findall(doc)}
    contents = _contents(package)
    assert not contents - named, f"{folder}/__init__.py does not name {sorted(contents - named)}"
    gone = {n for n in named if n.endswith(".py")} - contents
    assert not gone, f"{folder}/__init__.py names {sorted(gone)}, which are not in the package"
