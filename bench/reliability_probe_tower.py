"""Issue 44 item 1, the towers' attention: one large group costs memory linear
in its patches (a 3-D SDPA call took torch's math path on CPU and held
heads x n x n scores: an 8-frame 8K clip OOM-killed the encoder).

`probe_tower_attention(p, model_dir, out)`, for `epd bench reliability-probe`:

  1t  the checkpoint's tower over one 24,128-patch group (the 8K clip's
      1856 x 3328 group under Qwen3-VL's video budget), in a fresh process:
      its peak RSS growth and seconds, against one copy of the scores
  1s  `epd serve` (e-pd, default flags), one chat request whose video_url is
      an 8-frame 7680 x 4320 H.264 clip: status, seconds, the encoder's peak
      RSS growth (VmHWM), below one copy of the scores; a text request answers after
"""
from __future__ import annotations

import base64
import io
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from epd.bench.body_memory import _status_kib
from epd.bench.compare import ServeProcess, cpu_set

# The 8K clip's group under Qwen3-VL's video budget: 1856 x 3328 pixels, 16-pixel patches.
GROUP_GRID = (1, 208, 116)  # 24,128 patches

# Loads the checkpoint's tower in a fresh interpreter and runs one group;
# prints {"peak_bytes": VmHWM growth over the forward, "seconds", "num_heads"}.
_TOWER_CHILD = r"""
import json, re, sys, time
import torch
from transformers import AutoConfig
from epd.encoders.loader import load_vision_tower

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


def eight_k_clip(num_frames: int = 8, width: int = 7680, height: int = 4320, fps: int = 2) -> bytes:
    """An H.264 clip of flat frames with a moving block (~100 KB), built one frame at a time."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "ultrafast", "crf": "40"}  # seconds, not minutes, at 8K
        for i in range(num_frames):
            frame = np.full((height, width, 3), (40 * i % 256, 90, 160), dtype=np.uint8)
            frame[height // 4:height // 2, i * width // num_frames:(i + 1) * width // num_frames] = 255  # moves
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return buf.getvalue()


def _encoder_pid(server: ServeProcess, timeout_s: float = 30) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.findall(r"EPD: worker encoder-0 pid (\d+)", server.log_path.read_text())
        if found:
            return int(found[-1])  # the latest, after any restart
        time.sleep(0.2)
    raise TimeoutError("no encoder pid in the server log")


def _long_context_copy(model_dir: str, dest: Path, max_len: int = 32768) -> Path:
    """The checkpoint with room for the clip's ~12,100 tokens (a tiny preset allows 4,096):
    config.json rewritten, every other file linked."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in Path(model_dir).iterdir():
        if f.name != "config.json" and not (dest / f.name).exists():
            (dest / f.name).symlink_to(f.resolve())
    config = json.loads((Path(model_dir) / "config.json").read_text())
    text = config.get("text_config", config)
    text["max_position_embeddings"] = max(int(text.get("max_position_embeddings", 0)), max_len)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


def probe_tower_attention(p: "Probe", model_dir: str, out: Path) -> None:  # noqa: F821 - bench/reliability_probe.py's
    """Issue 44 item 1 (the towers' attention), tower and server level."""
    tower = tower_group_peak(model_dir)
    n = GROUP_GRID[0] * GROUP_GRID[1] * GROUP_GRID[2]
    scores_bytes = tower["num_heads"] * n * n * 4  # one float32 copy of the math path's scores
    p.check("1t", f"tower, one {n:,}-patch group: peak RSS growth MiB, seconds (one score copy "
                  f"{scores_bytes / 2**20:,.0f} MiB)", tower["peak_bytes"] < scores_bytes / 4,
            {"peak_mib": round(tower["peak_bytes"] / 2**20, 1), "seconds": tower["seconds"]})

    clip = eight_k_clip()
    url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    server = ServeProcess(str(_long_context_copy(model_dir, out / "tower-checkpoint")), "e-pd", cpu_set(None), [],
                          out / "server-tower.log")
    try:
        model = server.wait_ready(300)
        pid = _encoder_pid(server)
        before_kib = _status_kib(pid, "VmRSS")
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        started = time.monotonic()
        messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                 {"type": "text", "text": "What happens?"}]}]
        answer = httpx.post(server.base_url + "/v1/chat/completions", timeout=600,
                            json={"model": model, "messages": messages, "max_tokens": 4})
        seconds = time.monotonic() - started
        # the tower's share is 1t's (~60 MiB); the rest (~1.6 GiB) is decoding and preprocessing eight
        # 8K frames (issue 44 item 1's frame bound); the math path's scores alone were 2 x scores_bytes
        peak_mib = (_status_kib(pid, "VmHWM") - before_kib) / 1024
        p.check("1s", f"an 8-frame 7680x4320 H.264 clip ({len(clip) / 1e3:.0f} KB): status, seconds, "
                      f"encoder peak RSS growth MiB", answer.status_code == 200 and peak_mib < scores_bytes / 2**20,
                {"status": answer.status_code, "seconds": round(seconds, 1), "encoder_peak_mib": round(peak_mib),
                 "encoder_pid_same": _encoder_pid(server) == pid,
                 **({} if answer.status_code == 200 else {"body": answer.text[:300]})})
        text = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                          json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        p.check("1s", "a text request after", text.status_code == 200, text.status_code)
    finally:
        server.stop()


if __name__ == "__main__":
    from epd.bench.reliability_probe import Probe

    out_dir = Path(sys.argv[2] if len(sys.argv) > 2 else "bench-results/reliability-probe-tower")
    out_dir.mkdir(parents=True, exist_ok=True)
    probe = Probe(out_dir)
    probe_tower_attention(probe, sys.argv[1], out_dir)
    (out_dir / "reliability_probe_tower.json").write_text(json.dumps(probe.rows, indent=2))
    sys.exit(sum(not row["ok"] for row in probe.rows))
