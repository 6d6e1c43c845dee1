"""Issue 44's video reproductions (items 1 and 3), for `python -m bench.dev.reliability_probe`.

Each function starts one `epd serve` (e-pd, default video flags, an API key,
`--max-restarts 0`: a killed encoder shows as a 503, never as a retry), sends
real PyAV-made clips as data URLs and records, per case, the status, the
seconds and the peak resident memory the case added to the API process and
to the encoder (VmHWM after clear_refs, /proc/<pid>/status):

  probe_video_kwargs  3   mm_processor_kwargs num_frames 10**6 and 10**30 on a
                          small clip, min_pixels 8294400 on a 64x64 clip and
                          10**15: each a 400 naming the key, before any work
  probe_video_8k      1   an 8-frame 7680x4320 H.264 clip under the release's
                          video budget (4 frames of 3328x1856, 12,064 placeholders:
                          served by a copy of the checkpoint taking 32,768
                          positions): it ends without the encoder dying (its pid
                          unchanged; before: a 503, --max-restarts 0), and the server answers after. Run it with
                          the tower's memory-linear attention: before it, the
                          encoder's attention on 24,128 patches a group takes
                          heads x 24,128^2 floats (the issue's OOM kills)
"""
from __future__ import annotations

import base64
import io
import json
import re
import time
from pathlib import Path

import httpx
import numpy as np

from bench.dev.body_memory import _status_kib
from bench.dev.reliability_probe import AUTH, KEY, Probe
from epd.bench.compare import ServeProcess, cpu_set

REQUEST_TIMEOUT_S = 300.0


def h264_clip(num_frames: int, height: int, width: int, fps: int = 24) -> bytes:
    """An H.264 mp4 of smooth moving gradients (a few kB, or ~100 kB at 8K)."""
    import av

    y, x = np.mgrid[0:height, 0:width]
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps, options={"preset": "ultrafast"})
        stream.height, stream.width, stream.pix_fmt = height, width, "yuv420p"
        for i in range(num_frames):
            frame = np.stack([(x // 8 + i * 9) % 256, (y // 8 + i * 5) % 256, ((x + y) // 16) % 256], -1)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame.astype(np.uint8), format="rgb24")))
        container.mux(stream.encode())
    return buf.getvalue()


def _video_message(data: bytes) -> list[dict]:
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                         {"type": "text", "text": "What happens?"}]}]


def _encoder_pid(server: ServeProcess) -> int | None:
    found = re.findall(r"EPD: worker encoder-0 pid (\d+)", server.log_path.read_text())
    return int(found[-1]) if found else None


def _send(server: ServeProcess, model: str, data: bytes, kwargs: dict | None) -> dict:
    """One video request: status, error message, seconds, and the peak RSS it added
    to the API and the encoder (MiB; None: the process is gone)."""
    pids = {"api": server.proc.pid, "encoder": _encoder_pid(server)}
    before = {}
    for name, pid in pids.items():
        try:
            Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
            before[name] = _status_kib(pid, "VmRSS")
        except (OSError, RuntimeError, TypeError):
            before[name] = None
    body = {"model": model, "messages": _video_message(data), "max_tokens": 4}
    if kwargs is not None:
        body["mm_processor_kwargs"] = kwargs
    started = time.monotonic()
    try:
        r = httpx.post(server.base_url + "/v1/chat/completions", headers=AUTH, timeout=REQUEST_TIMEOUT_S, json=body)
        status, message = r.status_code, (r.json().get("error") or {}).get("message") if r.status_code != 200 else ""
    except httpx.HTTPError as exc:
        status, message = type(exc).__name__, ""
    row = {"status": status, "message": (message or "")[:160], "seconds": round(time.monotonic() - started, 2)}
    for name, pid in pids.items():
        try:
            row[f"{name}_peak_mib"] = round((_status_kib(pid, "VmHWM") - before[name]) / 1024, 1)
        except (OSError, RuntimeError, TypeError):
            row[f"{name}_peak_mib"] = None
    row["encoder_pid_unchanged"] = _encoder_pid(server) == pids["encoder"]
    return row


def _answers(server: ServeProcess, model: str) -> int:
    clip = h264_clip(8, 64, 64)
    return _send(server, model, clip, None)["status"]


def long_context_copy(model_dir: str, out: Path, max_positions: int = 32768) -> str:
    """`model_dir` with text_config.max_position_embeddings raised (the other files linked):
    the tiny presets take 4,096 positions, fewer than the 8K clip's 12,064 placeholders."""
    copy = out / "long-context-model"
    copy.mkdir(parents=True, exist_ok=True)
    for path in Path(model_dir).iterdir():
        if path.name != "config.json" and not (copy / path.name).exists():
            (copy / path.name).symlink_to(path.resolve())
    config = json.loads((Path(model_dir) / "config.json").read_text())
    text = config.get("text_config", config)
    text["max_position_embeddings"] = max(int(text.get("max_position_embeddings", 0)), max_positions)
    (copy / "config.json").write_text(json.dumps(config, indent=2))
    return str(copy)


def _serve(model_dir: str, log: Path) -> tuple[ServeProcess, str]:
    server = ServeProcess(model_dir, "e-pd", cpu_set(None), ["--api-key", KEY, "--max-restarts", "0"], log)
    return server, server.wait_ready(300, headers=AUTH)


def probe_video_kwargs(p: Probe, model_dir: str, out: Path) -> None:
    """Item 3 and the API half of item 1: per-request video kwargs past the video or
    the server's budget are 400s naming the key, found from the header alone."""
    small = h264_clip(8, 64, 64)
    cases = [("num_frames 10**6", {"num_frames": 10**6}, "num_frames"),
             ("num_frames 10**30", {"num_frames": 10**30}, "num_frames"),
             ("min_pixels 8294400 (64x64 -> 1440x1440)", {"min_pixels": 8294400}, "1440x1440"),
             ("min_pixels 10**15", {"min_pixels": 10**15}, "min_pixels")]
    server, model = _serve(model_dir, out / "video-kwargs.log")
    try:
        for what, kwargs, named in cases:
            row = _send(server, model, small, kwargs)
            p.check("44.3", f"{len(small)} B clip, {what}: a 400 naming it, API and encoder flat",
                    row["status"] == 400 and named in row["message"] and row["encoder_pid_unchanged"], row)
        p.check("44.3", "a plain video answers after", _answers(server, model) == 200, "")
    finally:
        server.stop()


def probe_video_8k(p: Probe, model_dir: str, out: Path, height: int = 4320, width: int = 7680) -> None:
    """Item 1: the 8-frame 8K H.264 clip under default flags: the encoder survives it
    (its peak RSS recorded), the request ends, the server answers after."""
    clip = h264_clip(8, height, width)
    server, model = _serve(long_context_copy(model_dir, out), out / "video-8k.log")
    try:
        row = _send(server, model, clip, None)
        p.check("44.1", f"8-frame {width}x{height} H.264 ({len(clip)} B): answered, the encoder lives",
                row["status"] == 200 and row["encoder_pid_unchanged"], row)
        p.check("44.1", "a plain video answers after", _answers(server, model) == 200, "")
    finally:
        server.stop()
