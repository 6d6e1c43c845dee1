"""`epd`'s parser loads no torch: `epd worker` sets OpenMP's wait policy after
parsing and before torch (and libgomp) load, so a bench module imported for its
flags must not import torch at its top (tests/e2e/serve/test_worker_cpu.py sees
the spinning this would cause; this finds the module at once)."""
from __future__ import annotations

import subprocess
import sys


def test_building_the_parser_imports_no_torch():
    code = ("import sys\nfrom epd.cli import build_parser\nbuild_parser()\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))[:3])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout
