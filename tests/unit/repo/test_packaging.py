"""The wheel exposes one import namespace, `epd`, and works installed (not editable)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # built from a copy: a checkout's own build/ keeps files since moved or deleted, which setuptools would ship
    source = tmp_path_factory.mktemp("source") / "epd"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__",
                                                                 ".pytest_cache"))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    (path,) = out.glob("epd-*.whl")
    return path


def test_the_wheel_holds_only_the_epd_namespace(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"epd", next(t for t in top if t.endswith(".dist-info"))}, sorted(top)
    for module in ("epd/engine/scheduler.py", "epd/transport/wire/messages.py", "epd/families/qwen_vl/vision_tower.py",
                   "epd/bench/serve.py", "epd/api/server.py", "epd/engine/attention/torch_attention.py",
                   "epd/cli/__init__.py", "epd/cli/__main__.py", "epd/api/fast_path.py",
                   # the CPU kernels' C sources, built where they run (transport/weights/c_library.py)
                   "epd/engine/attention/paged_attention_cpu.c", "epd/engine/layers/gated_delta_cpu.c",
                   "epd/transport/weights/quant/weight_only_cpu.c"):
        assert module in names


def test_the_wheel_ships_no_developer_experiment(wheel):
    """epd.bench is what `epd bench` runs: bench/'s own modules, and nothing of bench/dev/."""
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {n for n in names if n.startswith("epd/bench/")}
    assert shipped == {f"epd/bench/{p.name}" for p in (ROOT / "bench").glob("*.py")}, sorted(shipped)
    experiments = {p.name for p in (ROOT / "bench" / "dev").iterdir() if p.suffix in (".py", ".sh")} - {"__init__.py"}
    assert len(experiments) > 20 and not {f"epd/bench/{name}" for name in experiments} & set(names)


def test_the_installed_wheel_imports(wheel, tmp_path):
    target = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                             str(wheel)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    # run outside the repository with only the installed copy on the path
    env = {**os.environ, "PYTHONPATH": str(target)}
    code = ("import epd, epd.engine.scheduler, epd.transport.wire.messages, epd.api.protocol, epd.cli\n"
            "assert epd.__file__.startswith(%r), epd.__file__\n"
            "assert epd.engine.scheduler.__file__.startswith(%r)\n") % (str(target), str(target))
    result = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(target)!r})\n" + code],
                            capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
