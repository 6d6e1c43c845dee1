"""What the workers' forkserver imports (local_supervisor.WORKER_PRELOAD) must leave the GPU
alone: a forked child cannot use CUDA once its parent did (on an H200, xgrammar's FFI layer
JIT-built and loaded a CUDA torch extension at import, and every worker failed its start)."""
from __future__ import annotations

import os
import subprocess
import sys

from epd.processes.local_supervisor import WORKER_PRELOAD


def test_the_preload_loads_no_torch_extension_for_xgrammar():
    code = "\n".join([*(f"import {m}" for m in WORKER_PRELOAD),
                      "import tvm_ffi._optional_torch_c_dlpack as dlpack",
                      "print(hasattr(dlpack, '_LIB'))"])
    env = {k: v for k, v in os.environ.items() if k != "TVM_FFI_DISABLE_TORCH_C_DLPACK"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False"]  # the extension's loader never ran
