"""Issue 44's runtime-LoRA reproductions (items 2, 4, 5, 8), as one probe function.

`probe_lora(p, model_dir, out)` starts one `epd serve` (e-p-d, --enable-lora,
--max-loras 2, --max-cpu-loras 2, --allow-runtime-lora-updating), attacks it
over HTTP with real adapter directories, and stops it:

  2   an adapter loaded, its directory deleted, pushed out of host memory by
      two others, then requested while a base stream runs: a 400/404 naming
      it, no worker restart, /health 200, the stream ends normally; an
      adapter unloaded (and deleted) while its stream runs: the stream ends
  4   a 78 MB safetensors header (600k entries): refused, and the slowest
      /health answered meanwhile; a sparse 2 GB weights file: refused
  5   150 runtime loads of one adapter under 150 names: each engine worker's
      resident memory (VmRSS) before and after, and the adapters it holds in
      host memory (epd:lora_cpu_adapters)
  8   a missing directory and one without adapter_config.json: one answer

The adapter writers are torch-free (a PEFT directory written by hand) and
are shared with tests/e2e/serve/test_lora_serve.py.
"""
from __future__ import annotations

import json
import random
import re
import shutil
import struct
import threading
import time
from pathlib import Path

import httpx

from bench.dev.body_memory import _status_kib
from bench.dev.reliability_probe import Probe
from epd.bench.compare import ServeProcess, cpu_set

TOWER_KEY = "base_model.model.model.visual.blocks.0.attn.qkv.lora_{}.weight"  # ignored without tower LoRA


def write_adapter(model_dir: str, out: Path, r: int = 8, seed: int = 0) -> Path:
    """A PEFT LoRA adapter on every layer's q_proj and v_proj, random float32 weights."""
    tc = json.loads((Path(model_dir) / "config.json").read_text())["text_config"]  # Qwen-VL's layout
    hidden, heads = tc["hidden_size"], tc["num_attention_heads"]
    head_dim = tc.get("head_dim") or hidden // heads
    sizes = {"q_proj": (hidden, heads * head_dim),
             "v_proj": (hidden, tc.get("num_key_value_heads", heads) * head_dim)}
    rng = random.Random(seed)
    tensors = {}
    for layer in range(tc["num_hidden_layers"]):
        for module in ("q_proj", "v_proj"):
            in_f, out_f = sizes[module]
            name = f"base_model.model.model.language_model.layers.{layer}.self_attn.{module}.lora_{{}}.weight"
            tensors[name.format("A")] = ([r, in_f], [rng.gauss(0, 0.1) for _ in range(r * in_f)])
            tensors[name.format("B")] = ([out_f, r], [rng.gauss(0, 0.1) for _ in range(out_f * r)])
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": ["q_proj", "v_proj"], "bias": "none"}))
    header, data, at = {}, bytearray(), 0
    for name, (shape, values) in tensors.items():
        blob = struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [at, at + len(blob)]}
        data += blob
        at += len(blob)
    _write_weights(out, header, bytes(data))
    return out


def read_weights(adapter: Path) -> tuple[dict, bytes]:
    raw = (adapter / "adapter_model.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + size]), raw[8 + size:]


def _write_weights(adapter: Path, header: dict, data: bytes, pad_to: int = 0) -> None:
    blob = json.dumps(header).encode()
    with (adapter / "adapter_model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + data)
        if pad_to:
            f.truncate(8 + len(blob) + pad_to)  # a hole: no disk taken, read back as zeros


def write_big_header(src: Path, out: Path, num_entries: int) -> Path:
    """`src`'s adapter with `num_entries` more well-formed tensors of no data in its header."""
    shutil.copytree(src, out)
    header, data = read_weights(src)
    for i in range(num_entries):
        header[f"base_model.model.model.visual.pad.{i}.lora_A.weight"] = {
            "dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
    _write_weights(out, header, data)
    return out


def write_sparse(src: Path, out: Path, num_bytes: int) -> Path:
    """`src`'s adapter with one more (vision tower) tensor of `num_bytes`, a sparse hole."""
    shutil.copytree(src, out)
    header, data = read_weights(src)
    r = json.loads((src / "adapter_config.json").read_text())["r"]
    cols = num_bytes // 4 // r
    header[TOWER_KEY.format("A")] = {"dtype": "F32", "shape": [r, cols],
                                     "data_offsets": [len(data), len(data) + 4 * r * cols]}
    _write_weights(out, header, data, pad_to=len(data) + 4 * r * cols)
    return out


def _post(base: str, path: str, body: dict, timeout_s: float = 120) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=timeout_s)


def _complete(base: str, model: str, max_tokens: int = 4) -> httpx.Response:
    return _post(base, "/v1/completions", {"model": model, "prompt": list(range(200, 240)),
                                           "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


def _stream(base: str, model: str, max_tokens: int, chunks: list, first: threading.Event) -> None:
    """A streamed completion; `chunks` gets each event's JSON (or the error), `first` set at the first."""
    body = {"model": model, "prompt": list(range(300, 340)), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
                    first.set()
                elif line == "data: [DONE]":
                    chunks.append("[DONE]")
    except httpx.HTTPError as exc:
        chunks.append(f"{type(exc).__name__}: {exc}")
    first.set()


def _finish(chunks: list) -> str | None:
    return next((c["choices"][0]["finish_reason"] for c in reversed(chunks) if isinstance(c, dict)
                 and c.get("choices") and c["choices"][0].get("finish_reason")), None)


def _metric(base: str, name: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=10).text
    return {labels: float(v) for labels, v in re.findall(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M)}


def _worker_pids(log_path: Path) -> dict[str, int]:
    return {w: int(pid) for w, pid in re.findall(r"EPD: worker (\S+) pid (\d+)", log_path.read_text())}


def _health_while(base: str, running: threading.Event, latencies: list) -> None:
    while running.is_set():
        started = time.monotonic()
        code = httpx.get(base + "/health", timeout=60).status_code
        latencies.append((round(time.monotonic() - started, 3), code))
        time.sleep(0.05)


def probe_lora(p: Probe, model_dir: str, out: Path, cpus: str | None = None) -> None:
    """Items 2, 4, 5 and 8 of issue 44 against one e-p-d server; see the module docstring."""
    out = Path(out)
    work = out / "lora"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    base_adapter = write_adapter(model_dir, work / "base-adapter", r=16)
    server = ServeProcess(model_dir, "e-p-d", cpu_set(cpus),
                          ["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "2", "--max-lora-rank", "16",
                           "--allow-runtime-lora-updating", "--max-local-prefill-tokens", "16"],
                          out / "server-lora.log")
    try:
        model = server.wait_ready(300)
        time.sleep(1.5)  # the workers' first stats
        _probe_deleted(p, server, model, base_adapter, work)
        _probe_unload_mid_stream(p, server, base_adapter, work)
        _probe_headers(p, server, base_adapter, work)
        _probe_not_found(p, server, work)
        _probe_many_loads(p, server, base_adapter)
    except Exception as exc:  # noqa: BLE001 - the probe reports what broke and stops
        p.check("2-8", "the LoRA probe ran to the end", False, f"{type(exc).__name__}: {exc}")
    finally:
        server.stop()


def _probe_deleted(p: Probe, server: ServeProcess, model: str, base_adapter: Path, work: Path) -> None:
    base = server.base_url
    names = {n: shutil.copytree(base_adapter, work / n) for n in ("gone", "other1", "other2")}
    for n, path in names.items():
        _post(base, "/v1/load_lora_adapter", {"lora_name": n, "lora_path": str(path)}).raise_for_status()
    first = _complete(base, "gone").status_code
    shutil.rmtree(names["gone"])
    pushed = [_complete(base, n).status_code for n in ("other1", "other2")]
    chunks, started = [], threading.Event()
    stream = threading.Thread(target=_stream, args=(base, model, 64, chunks, started))
    stream.start()
    started.wait(60)
    begin = time.monotonic()
    r = _complete(base, "gone")
    seconds = round(time.monotonic() - begin, 2)
    stream.join(300)
    restarts = sum(_metric(base, "epd:worker_restarts_total").values())
    health = httpx.get(base + "/health", timeout=10).status_code
    p.check("2", "the deleted adapter: 400/404 naming it, at once",
            r.status_code in (400, 404) and "'gone'" in r.text,
            {"status": r.status_code, "seconds": seconds, "body": r.text[:200], "before": [first, *pushed]})
    p.check("2", "no worker restarted, /health 200", restarts == 0 and health == 200,
            {"restarts": restarts, "health": health})
    p.check("2", "another user's stream ended normally", _finish(chunks) == "length" and chunks[-1] == "[DONE]",
            chunks[-1] if chunks else None)


def _probe_unload_mid_stream(p: Probe, server: ServeProcess, base_adapter: Path, work: Path) -> None:
    base = server.base_url
    path = shutil.copytree(base_adapter, work / "brief")
    _post(base, "/v1/load_lora_adapter", {"lora_name": "brief", "lora_path": str(path)}).raise_for_status()
    chunks, started = [], threading.Event()
    stream = threading.Thread(target=_stream, args=(base, "brief", 400, chunks, started))
    stream.start()
    started.wait(60)
    shutil.rmtree(path)  # a re-read fails: the running stream must not need one
    unloaded = _post(base, "/v1/unload_lora_adapter", {"lora_name": "brief"}).status_code
    was_running = stream.is_alive()
    stream.join(300)
    tokens = sum(len(c["choices"][0].get("text", "")) > 0 for c in chunks if isinstance(c, dict) and c.get("choices"))
    p.check("2", "unloaded and deleted mid-stream: its stream ends normally",
            unloaded == 200 and was_running and _finish(chunks) == "length",
            {"unload": unloaded, "was_running": was_running, "finish": _finish(chunks), "events": tokens})


def _probe_headers(p: Probe, server: ServeProcess, base_adapter: Path, work: Path) -> None:
    base = server.base_url
    api_pid = server.proc.pid
    big = write_big_header(base_adapter, work / "big-header", 600_000)
    Path(f"/proc/{api_pid}/clear_refs").write_text("5")
    rss_before = _status_kib(api_pid, "VmRSS")
    running, latencies = threading.Event(), []
    running.set()
    poller = threading.Thread(target=_health_while, args=(base, running, latencies))
    poller.start()
    begin = time.monotonic()
    r = _post(base, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(big)})
    seconds = round(time.monotonic() - begin, 2)
    running.clear()
    poller.join(60)
    peak_mib = round((_status_kib(api_pid, "VmHWM") - rss_before) / 1024, 1)
    header_mb = round((big / "adapter_model.safetensors").stat().st_size / 1e6, 1)
    p.check("4", f"a {header_mb} MB header (600k entries): refused", r.status_code == 400,
            {"status": r.status_code, "seconds": seconds, "api_peak_rss_over_before_mib": peak_mib,
             "slowest_health_s": max((s for s, _ in latencies), default=None), "body": r.text[:160]})
    sparse = write_sparse(base_adapter, work / "sparse", 2 << 30)
    begin = time.monotonic()
    r = _post(base, "/v1/load_lora_adapter", {"lora_name": "sparse", "lora_path": str(sparse)})
    seconds = round(time.monotonic() - begin, 2)
    p.check("4", "a sparse 2 GiB weights file: refused", r.status_code == 400,
            {"status": r.status_code, "seconds": seconds, "body": r.text[:200]})
    if r.status_code == 200:  # what it costs when it passes: every engine worker reads it per request
        begin = time.monotonic()
        served = _complete(base, "sparse").status_code
        p.check("4", "the sparse adapter's first request", False,
                {"status": served, "seconds": round(time.monotonic() - begin, 2)})
        _post(base, "/v1/unload_lora_adapter", {"lora_name": "sparse"})


def _probe_not_found(p: Probe, server: ServeProcess, work: Path) -> None:
    (work / "empty-dir").mkdir()
    answers = []
    for name, path in (("missing", work / "no-such-dir"), ("empty", work / "empty-dir")):
        r = _post(server.base_url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        answers.append((r.status_code, r.json()["error"]["type"],
                        r.json()["error"]["message"].replace(str(path), "<path>").replace(name, "<name>")))
    p.check("8", "a missing directory and one without adapter_config.json: one answer",
            answers[0] == answers[1], answers)


def _probe_many_loads(p: Probe, server: ServeProcess, base_adapter: Path, num_loads: int = 150) -> None:
    base = server.base_url
    pids = {w: pid for w, pid in _worker_pids(server.log_path).items() if not w.startswith("encoder")}
    before = {w: _status_kib(pid, "VmRSS") for w, pid in pids.items()}
    codes = [_post(base, "/v1/load_lora_adapter", {"lora_name": f"many-{i}", "lora_path": str(base_adapter)}
                   ).status_code for i in range(num_loads)]
    time.sleep(3)  # the workers' reads and their next stats (every 0.25 s)
    grew = {w: round((_status_kib(pid, "VmRSS") - before[w]) / 1024, 1) for w, pid in pids.items()}
    held = _metric(base, "epd:lora_cpu_adapters")
    p.check("5", f"{num_loads} loads under {num_loads} names: each engine worker holds at most --max-cpu-loras",
            codes.count(200) == num_loads and held and max(held.values()) <= 2,
            {"rss_growth_mib": grew, "epd:lora_cpu_adapters": held, "loads_200": codes.count(200)})
