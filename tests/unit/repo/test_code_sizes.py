"""Issue 30's size rule, kept: no Python file of the repository over 500
lines, and no function in epd/serve or epd/api (the layers a request's life
runs through, where features land) over 60 lines. A file or function past
them is a sign it does two jobs; split it where the jobs part.

Markdown (docs/benchmarks_archive.md is a logbook of measurements) and data files
(the vendored RayCluster schema) are not code and not counted."""
from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60
FUNCTION_DIRS = ("epd/serve", "epd/api")


def _python_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / name for name in listed if (ROOT / name).exists()]


def test_no_python_file_is_over_500_lines():
    files = _python_files()
    assert len(files) > 100  # the listing found the tree
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert long == {}


def test_no_function_in_the_serving_layers_is_over_60_lines():
    long = {}
    for path in _python_files():
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(FUNCTION_DIRS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{rel}:{node.lineno} {node.name}"] = lines
    assert long == {}
