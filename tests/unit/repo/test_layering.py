"""The dependency rule of docs/design.md ("Layout and the layering rule"),
checked on every import statement.

    transport  imports nothing of ours
    encoders   imports transport, and the family registry (epd/families/registry.py)
    engine     imports transport, and the family registry
    families   (epd/families/) import transport, engine and encoders: the layers they are built from
    bench      talks to the server over HTTP (the offline benchmark, and the mode
               comparison and the planner, which launch servers, aside)
    epd        wires everything; only the CLI reaches into bench
    bench/dev  the developer experiments, outside the wheel: they may import
               anything of ours (as epd.*, each other as bench.dev.*), and
               nothing installed imports them

Imports inside functions and under `if TYPE_CHECKING:` count too: a reader
following a type across the rule crosses it as much as the interpreter does.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
# repository folder -> installed package
PACKAGES = {"epd": "epd", "engine": "epd.engine", "transport": "epd.transport",
            "encoders": "epd.encoders", "bench": "epd.bench"}
LAYERS = ("epd.engine", "epd.transport", "epd.encoders", "epd.bench", "epd.families")
# what the engine and the encoders may import of the families: the registry, which names the rest by string
FAMILY_DOOR = ("epd.families.registry", "epd.families.model_family")

# layer -> the other layers of ours it may import
ALLOWED = {
    "epd.transport": set(),
    "epd.encoders": {"epd.transport"},
    "epd.engine": {"epd.transport"},
    "epd.bench": set(),
    "epd.families": {"epd.transport", "epd.engine", "epd.encoders"},
}
# bench modules that run our code in-process, and why
BENCH_IN_PROCESS = {
    "epd.bench.offline": "the offline engine benchmark runs LLM and transformers side by side",
    "epd.bench.compare": "launches `epd serve` per mode and reads the mode names from its config",
    "epd.bench.plan": "launches `epd serve` per split, as compare does, and reads the niceness per role",
    "epd.bench.plan_measure": "measures each stage's service time with the offline engine (LLM)",
    "epd.bench.plan_sim": "routes short text prompts with the orchestrator's own rule (router.idle_prefill_workers) "
                          "and gives each worker the threads serve gives it (threads.worker_threads)",
}
DEV = ROOT / "bench" / "dev"  # the developer experiments: run from a checkout as bench.dev.*, not installed
TOP_LEVEL_NAMES = ("engine", "transport", "encoders", "bench")


def _modules(folders=tuple(PACKAGES)):
    for folder in folders:
        package = PACKAGES[folder]
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.is_relative_to(DEV):
                continue
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            yield ".".join([package, *parts]), path


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}:{node.lineno}: relative import; use the full epd.* name")
    return found


def _layer(module: str) -> str:
    for layer in LAYERS:
        if module == layer or module.startswith(layer + "."):
            return layer
    return "epd" if module == "epd" or module.startswith("epd.") else ""


def test_no_module_crosses_the_layering_rule():
    violations = []
    for module, path in _modules():
        own = _layer(module)
        for line, target in _imports(path):
            where = f"{path.relative_to(ROOT)}:{line} imports {target}"
            if target.split(".")[0] in TOP_LEVEL_NAMES:
                violations.append(f"{where} (installed only as epd.{target.split('.')[0]})")
                continue
            dep = _layer(target)
            if not dep or dep == own:
                continue
            if own == "epd":
                if dep == "epd.bench" and module != "epd.cli" and not module.startswith("epd.cli."):
                    violations.append(f"{where} (only the CLI runs benchmarks)")
                continue
            if own == "epd.bench" and module in BENCH_IN_PROCESS:
                continue
            if own in ("epd.engine", "epd.encoders") and target.startswith(FAMILY_DOOR):
                continue
            if dep not in ALLOWED[own]:
                violations.append(f"{where} ({own} may import {sorted(ALLOWED[own]) or 'nothing of ours'})")
    assert not violations, "\n".join(violations)


def test_nothing_installed_imports_the_experiments():
    importing = [f"{path.relative_to(ROOT)}:{line} imports {target}" for _, path in _modules()
                 for line, target in _imports(path) if target.startswith(("bench.dev", "epd.bench.dev"))]
    assert not importing, "\n".join(importing)


def test_the_experiments_import_ours_by_installed_names():
    """bench/dev imports the product as epd.* (one copy of each module) and its own files as
    bench.dev.*; a `bench.serve` or `engine.x` would load a second copy from the checkout."""
    paths = sorted(DEV.glob("*.py"))
    assert len(paths) > 20
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {target}" for path in paths
             for line, target in _imports(path)
             if target.split(".")[0] in TOP_LEVEL_NAMES and not target.startswith("bench.dev.")]
    assert not wrong, "\n".join(wrong)


def test_the_walker_sees_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from epd.engine.worker.loop import EngineWorker\n")
    assert (2, "epd.engine.worker.loop.EngineWorker") in _imports(bad)
    assert _layer("epd.engine.worker.loop.EngineWorker") == "epd.engine"
    assert "epd.engine" not in ALLOWED["epd.transport"]


def test_a_familys_vision_side_loads_no_engine_code():
    """The encoders build a family's vision side (`ModelFamily.vision`): it must not pull the engine in."""
    code = ("import sys\n"
            "from epd.families.registry import FAMILIES\n"
            "from epd.families.model_family import resolve\n"
            "for family in FAMILIES.values():\n"
            "    resolve(family.vision)\n"
            "engine = [m for m in sys.modules if m.startswith('epd.engine')]\n"
            "assert not engine, engine\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT / "tests")
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("entry", ["epd.api.server", "epd.serve.orchestrator"])
def test_the_api_process_does_not_load_model_code(entry):
    """The API converts spans, reads headers and routes: it needs no model, no
    engine worker and no vision tower in its process."""
    code = (f"import sys, {entry}\n"
            "heavy = [m for m in sys.modules if m.startswith(('epd.engine.worker.loop', 'epd.families.qwen_vl.text_model',"
            " 'epd.engine.layers', 'epd.engine.model_runner', 'epd.families.qwen_vl.vision_tower',"
            " 'epd.encoders.image_encoder', 'epd.encoders.encoder_worker', 'epd.families.gemma3.text_model',"
            " 'epd.families.gemma3.vision'))]\n"
            "assert not heavy, heavy\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT / "tests")
    assert result.returncode == 0, result.stderr


# -- the serving layer's request types, and import circles -----------------------------------

CYCLE_FREE = ("epd", "engine", "transport", "encoders")  # repository folders whose files import no circle


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(path: Path) -> list[str]:
    """Every name imported at run time (inside functions too), `if TYPE_CHECKING:` blocks left out."""
    found = []

    def visit(nodes) -> None:
        for node in nodes:
            if _is_type_checking(node):
                visit(node.orelse)
            elif isinstance(node, ast.Import):
                found.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.extend(f"{node.module}.{alias.name}" for alias in node.names)
            else:
                visit(ast.iter_child_nodes(node))

    visit([ast.parse(path.read_text(), filename=str(path))])
    return found


def _import_graph(folders=tuple(PACKAGES)) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports at run time (a `from a.b import c`
    names module a.b.c when that is one, else a.b)."""
    paths = dict(_modules(folders))
    graph = {}
    for module, path in paths.items():
        targets = set()
        for name in _runtime_imports(path):
            target = name if name in paths else name.rpartition(".")[0]
            if target in paths and target != module:
                targets.add(target)
        graph[module] = targets
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (its modules, first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


def _closure(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += graph.get(module, ())
    return seen


def test_no_import_circle_between_files():
    graph = _import_graph(CYCLE_FREE)
    assert {"epd.serve.orchestrator", "epd.engine.engine_core", "epd.transport.wire.messages",
            "epd.encoders.encoder_worker"} <= set(graph)  # every folder walked
    cycle = _find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_circle_finder_sees_a_circle(tmp_path):
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from epd.x import y\n"
                      "def f():\n    import epd.z\n")
    assert _runtime_imports(source) == ["typing.TYPE_CHECKING", "epd.z"]


def test_the_orchestrator_imports_nothing_of_the_http_edge():
    """The serving layer speaks epd/requests.py's types; only the start-up code that
    composes the API server with the workers (launcher, api_servers) sees both."""
    graph = _import_graph()
    reached = _closure(graph, "epd.serve.orchestrator")
    assert {"epd.requests", "epd.serve.registry", "epd.config"} <= reached  # the walk follows imports
    assert not [m for m in reached if m.startswith("epd.api")]
    assert "epd.api.protocol" in _closure(graph, "epd.api.server")  # and would see one


def test_the_request_types_load_no_torch():
    """Both sides of the serving layer speak them: importing them costs no model code."""
    code = "import sys, epd.requests\nassert 'torch' not in sys.modules, 'epd.requests imported torch'\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT / "tests")
    assert result.returncode == 0, result.stderr
