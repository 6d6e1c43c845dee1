"""The CPU paged decode attention kernel (paged_attention_cpu.c): built once, loaded with ctypes.

The torch backend's decodes gather every sequence's K and V out of its blocks
before SDPA reads them: on CPU that copy was a quarter of the decode worker's
time at 32 streams (docs/benchmarks_archive.md). The kernel reads K and V
in place through the block table. No library offers one for torch 2.13 on
CPU (vLLM's is compiled into vLLM; IPEX's stopped at older torch), so it is
ours: plain C with OpenMP, no torch headers, so it builds in about a second
with the system's C compiler on first use, into a cache directory
(`$EPD_KERNEL_CACHE`, default ~/.cache/epd/kernels) under a name that hashes
the source, the flags and this CPU's features. Without a compiler (or with
`EPD_CPU_ATTENTION_KERNEL=0`) `load()` returns None and the torch backend
keeps its gather + SDPA path: same results, slower.
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
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention_cpu.c")
# Compiled with -ffast-math (vectorised sums and expf), linked without it: linked with it, GCC adds
# crtfastmath, whose loading flushes subnormals to zero in the whole process (torch's sums too).
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]
LINK_FLAGS = ["-shared", "-fopenmp"]
_lock = threading.Lock()
_loaded: list = []  # [the function or None] once load() has run


def _cpu_features() -> str:
    """This CPU's model and flags: a library built with -march=native for one CPU may not run on another."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))


def library_path(compiler: str) -> Path:
    cache = Path(os.environ.get("EPD_KERNEL_CACHE") or Path.home() / ".cache" / "epd" / "kernels")
    parts = [SOURCE.read_text(), compiler, *COMPILE_FLAGS, *LINK_FLAGS, _cpu_features()]
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()
    return cache / f"paged_attention_cpu-{digest[:16]}.so"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # built beside the target and renamed: processes starting at once never load half a file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    obj = tmp + ".o"
    try:
        for argv in ([compiler, *COMPILE_FLAGS, "-c", str(SOURCE), "-o", obj], [compiler, *LINK_FLAGS, obj, "-o", tmp, "-lm"]):
            subprocess.run(argv, check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)


def load():
    """The kernel's ctypes function, or None where it cannot be built (logged once)."""
    with _lock:
        if not _loaded:
            _loaded.append(_load())
        return _loaded[0]


def _load():
    if os.environ.get("EPD_CPU_ATTENTION_KERNEL", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: CPU decode attention gathers K/V for SDPA (slower)")
        return None
    path = library_path(compiler)
    try:
        if not path.exists():
            _build(compiler, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("CPU attention kernel not built (%s): CPU decode attention gathers K/V for SDPA (slower)",
                    str(detail).strip()[:500])
        return None
    fn = lib.epd_paged_decode_attention
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, p, p, p, i64, p, p, p, i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_float, p,
                   ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def decode_attention(fn, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_ids: torch.Tensor, scale: float,
                     out: torch.Tensor, window: int | None = None, softcap: float | None = None) -> None:
    """Writes `out`'s rows of the sequences `seq_ids` (int64); every tensor float32 / int32 on CPU and
    contiguous (`query` and `out` [num_tokens, Hq, D], caches [num_blocks, block_size, Hkv, D]).
    `window`, `softcap`: the layer's sliding window and attention logit soft-cap (None: off)."""
    num_q_heads, head_dim = query.shape[1:]
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    rc = fn(query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
            seq_lens.data_ptr(), cu_seqlens_q.data_ptr(), seq_ids.data_ptr(), seq_ids.numel(),
            num_q_heads, num_kv_heads, head_dim, block_size, window or 0, scale, softcap or 0.0, out.data_ptr(),
            torch.get_num_threads())
    if rc != 0:
        raise MemoryError("CPU attention kernel: no memory for its scores")
