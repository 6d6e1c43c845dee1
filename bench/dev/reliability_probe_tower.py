"""Issue 44 item 1, the towers' attention: one large group costs memory linear
in its patches (a 3-D SDPA call took torch's math path on CPU and held
heads x n x n scores: an 8-frame 8K clip OOM-killed the encoder).

`probe_tower_attention(p, model_dir, out)`, for `python -m bench.dev.reliability_probe`:

  1t  the checkpoint's tower over one 24,128-patch group (the 8K clip's
      1856 x 3328 group under Qwen3-VL's video budget), in a fresh process:
      its peak RSS growth and seconds, against one copy of the scores

The same clip through `epd serve` is reliability_probe_video.probe_video_8k.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# The 8K clip's group under Qwen3-VL's video budget: 1856 x 3328 pixels, 16-pixel patches.
GROUP_GRID = (1, 208, 116)  # 24,128 patches

# Loads the checkpoint's tower in a fresh interpreter and runs one group;
# prints {"peak_bytes": VmHWM growth over the forward, "seconds", "num_heads"}.
_TOWER_CHILD = r"""
import json, re, sys, time
import torch
from transformers import AutoConfig
from epd.families.qwen_vl.vision import load_vision_tower

model_dir, t, h, w = sys.argv[1], *map(int, sys.argv[2:5])
config = AutoConfig.from_pretrained(model_dir)
tower = load_vision_tower(model_dir, config, torch.float32)
vc = config.vision_config
pixels = torch.randn(t * h * w, vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2)
tower(pixels[:64], [(1, 8, 8)])  # warm up kernels and allocator

def peak_kib():
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1))

open("/proc/self/clear_refs", "w").write("5")  # VmHWM := the current RSS
before, started = peak_kib(), time.monotonic()
tower(pixels, [(t, h, w)])
print(json.dumps({"peak_bytes": (peak_kib() - before) * 1024, "seconds": round(time.monotonic() - started, 2),
                  "num_heads": vc.num_heads}))
"""


def tower_group_peak(model_dir: str, grid: tuple[int, int, int] = GROUP_GRID, timeout_s: float = 600) -> dict:
    """The checkpoint's tower over one group of `grid` patches, in float32 in a fresh process."""
    done = subprocess.run([sys.executable, "-c", _TOWER_CHILD, model_dir, *map(str, grid)],
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"tower run exited {done.returncode}: {done.stderr[-1000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def probe_tower_attention(p: "Probe", model_dir: str, out: Path) -> None:  # noqa: F821 - bench/dev/reliability_probe.py's
    """Issue 44 item 1 (the towers' attention): one group through the tower alone."""
    tower = tower_group_peak(model_dir)
    n = GROUP_GRID[0] * GROUP_GRID[1] * GROUP_GRID[2]
    scores_bytes = tower["num_heads"] * n * n * 4  # one float32 copy of the math path's scores
    p.check("1t", f"tower, one {n:,}-patch group: peak RSS growth MiB, seconds (one score copy "
                  f"{scores_bytes / 2**20:,.0f} MiB)", tower["peak_bytes"] < scores_bytes / 4,
            {"peak_mib": round(tower["peak_bytes"] / 2**20, 1), "seconds": tower["seconds"]})


if __name__ == "__main__":
    from bench.dev.reliability_probe import Probe

    out_dir = Path(sys.argv[2] if len(sys.argv) > 2 else "bench-results/reliability-probe-tower")
    out_dir.mkdir(parents=True, exist_ok=True)
    probe = Probe(out_dir)
    probe_tower_attention(probe, sys.argv[1], out_dir)
    (out_dir / "reliability_probe_tower.json").write_text(json.dumps(probe.rows, indent=2))
    sys.exit(sum(not row["ok"] for row in probe.rows))
