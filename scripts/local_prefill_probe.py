"""Text-only TTFT while an image request is in flight, `--max-local-prefill-tokens`
512 (the default) against 0, on two e-p-d servers up side by side and probed
in alternation, so both see the same background load.

    .venv/bin/python scripts/local_prefill_probe.py MODEL [--rounds 6] [--images-first]

Each round, on each server in turn: an image request (~1,960 text tokens and
two 336x336 images: text first, so early prefill starts the prefill worker's
~2,048-token step at once; `--images-first`: the images first, so the
prefill worker is idle while they encode), then 1.0 s later a text-only
request (~400 tokens, under the threshold); both TTFTs are printed.
"""

from __future__ import annotations

import base64
import io
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time

import httpx
from PIL import Image

EPD = [sys.executable, "-m", "epd.cli"]

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def png(seed):
    rng = random.Random(seed)
    img = Image.new("RGB", (336, 336))
    img.putdata([(rng.randrange(256), rng.randrange(256), rng.randrange(256)) for _ in range(336 * 336)])
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

def start(extra, log):
    port = free_port()
    p = subprocess.Popen(EPD + ["serve", MODEL, "--mode", "e-p-d", "--port", str(port), *extra],
                         stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return p, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit("not ready")

def ttft(url, messages, max_tokens=8):
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                return time.perf_counter() - t0

def words(n, seed):
    rng = random.Random(seed)
    return " ".join(rng.choice(["red", "chair", "table", "light", "river", "stone", "blue", "house"]) for _ in range(n))

def main():
    import argparse
    global MODEL
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--images-first", action="store_true")
    p.add_argument("--log-dir", default=".")
    args = p.parse_args()
    MODEL, rounds = args.model, args.rounds
    servers = {"local off": start(["--max-local-prefill-tokens", "0"], os.path.join(args.log_dir, "probe-off.log")),
               "local 512": start([], os.path.join(args.log_dir, "probe-on.log"))}
    out = {k: {"text": [], "image": []} for k in servers}
    try:
        for name, (_, url) in servers.items():  # warm-up
            ttft(url, [{"role": "user", "content": "warm up"}])
        for i in range(rounds):
            for name, (_, url) in (servers.items() if i % 2 == 0 else reversed(list(servers.items()))):
                parts = [{"type": "image_url", "image_url": {"url": png(1000 * i + k)}} for k in (1, 2)]
                text = [{"type": "text", "text": words(700, i)}]
                img_msgs = [{"role": "user", "content": parts + text if args.images_first else text + parts}]
                res = {}
                t = threading.Thread(target=lambda: res.setdefault("img", ttft(url, img_msgs)))
                t.start()
                time.sleep(1.0)
                res["text"] = ttft(url, [{"role": "user", "content": words(140, 10_000 + i)}])
                t.join()
                out[name]["text"].append(res["text"]); out[name]["image"].append(res["img"])
                print(f"round {i} {name}: text TTFT {res['text']:.2f} s, image TTFT {res['img']:.2f} s, "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
                time.sleep(1.0)
        for name, (_, url) in servers.items():
            m = httpx.get(url + "/metrics").text
            print(name, [l for l in m.splitlines() if l.startswith("epd:local_prefills_total")])
    finally:
        for p, _ in servers.values():
            p.send_signal(2)
        for p, _ in servers.values():
            p.wait(60)
    for name, r in out.items():
        t = sorted(r["text"]); im = sorted(r["image"])
        print(f"{name}: text TTFT median {t[len(t)//2]:.2f} s max {t[-1]:.2f} s; image TTFT median {im[len(im)//2]:.2f} s max {im[-1]:.2f} s")

main()
