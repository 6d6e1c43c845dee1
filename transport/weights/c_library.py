"""A plain C source built on first use with the system's C compiler, cached, loaded with ctypes.

Our CPU kernels (engine/attention/paged_attention_cpu.c, engine/layers/gated_delta_cpu.c,
transport/weights/quant/weight_only_cpu.c) are plain C with OpenMP and no torch headers, so each builds in about a second. A build lands in
a cache directory (`$EPD_KERNEL_CACHE`, default ~/.cache/epd/kernels) under a name that hashes
the source, the compiler, the flags and this CPU's features, and is written beside its target
and renamed, so processes starting at once never load half a file. Without a compiler, or when
the build fails, `load` logs why once and returns None: the caller keeps its torch path.
`Kernel` is one function of such a source, built and typed once per process.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

# Compiled with -ffast-math (vectorised sums and expf), linked without it: linked with it, GCC adds
# crtfastmath, whose loading flushes subnormals to zero in the whole process (torch's sums too).
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]
LINK_FLAGS = ["-shared", "-fopenmp"]


def _cpu_features() -> str:
    """This CPU's model and flags: a library built with -march=native for one CPU may not run on another."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))


def library_path(source: Path, compiler: str) -> Path:
    cache = Path(os.environ.get("EPD_KERNEL_CACHE") or Path.home() / ".cache" / "epd" / "kernels")
    parts = [source.read_text(), compiler, *COMPILE_FLAGS, *LINK_FLAGS, _cpu_features()]
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()
    return cache / f"{source.stem}-{digest[:16]}.so"


def _build(source: Path, compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    obj = tmp + ".o"
    try:
        for argv in ([compiler, *COMPILE_FLAGS, "-c", str(source), "-o", obj], [compiler, *LINK_FLAGS, obj, "-o", tmp, "-lm"]):
            subprocess.run(argv, check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)


def load(source: Path, what: str, fallback: str) -> ctypes.CDLL | None:
    """`source` built (or found in the cache) and loaded, or None with a warning naming `what`
    was not built and the `fallback` the caller takes instead."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: %s (slower)", fallback)
        return None
    path = library_path(source, compiler)
    try:
        if not path.exists():
            _build(source, compiler, path)
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("%s not built (%s): %s (slower)", what, str(detail).strip()[:500], fallback)
        return None


class Kernel:
    """One C function of `source`, built, loaded and typed on the first `load()` of the process
    (thread-safe), or None where it cannot be: `switch` (an environment variable) set to 0, no
    compiler, a failed build (logged, naming `what` and the `fallback` the caller takes)."""

    def __init__(self, source: Path, symbol: str, argtypes: Sequence, restype, switch: str, what: str,
                 fallback: str):
        self.source, self.symbol, self.argtypes, self.restype = source, symbol, list(argtypes), restype
        self.switch, self.what, self.fallback = switch, what, fallback
        self._lock = threading.Lock()
        self._loaded: list = []  # [the function or None] once load() has run

    def load(self):
        """The ctypes function, or None (decided once)."""
        with self._lock:
            if not self._loaded:
                self._loaded.append(self.build())
            return self._loaded[0]

    def build(self):
        """The function built and loaded now (not remembered), or None."""
        if os.environ.get(self.switch, "1") == "0":
            return None
        lib = load(self.source, self.what, self.fallback)
        if lib is None:
            return None
        fn = getattr(lib, self.symbol)
        fn.argtypes, fn.restype = self.argtypes, self.restype
        return fn
