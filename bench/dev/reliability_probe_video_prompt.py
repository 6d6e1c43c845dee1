"""Issue 44 item 7's reproduction for `python -m bench.dev.reliability_probe`: a video
prompt is laid out as the release's own processor lays it out.

Qwen3-VL's release chat template writes `<|vision_start|><|video_pad|><|vision_end|>`
for a video; Qwen3VLProcessor (and vLLM) replace that whole wrapper with one
`<t seconds><|vision_start|>` pads `<|vision_end|>` per temporal group, and
Qwen2.5-VL's keeps it around one run of pads. Either way every
`<|vision_start|>` of the prompt opens a run of image or video pads that a
`<|vision_end|>` closes; the bug left one more `<|vision_start|>` per video,
followed by a timestamp (2 tokens too many, positions shifted).

`probe_video_prompt` starts one aggregated `epd serve` on the checkpoint (its
own chat template: a release's, or `epd make-model`'s, which writes the same
wrapper), sends a chat with two videos and an image with `return_token_ids`,
and checks the served prompt's token ids; it records the prompt's tokens,
the wrappers and pad runs it found, the seconds the request took and the
API's peak resident memory."""
from __future__ import annotations

import base64
import io
import time
from pathlib import Path

import httpx
from PIL import Image

from bench.dev.body_memory import _status_kib
from bench.dev.reliability_probe import Probe
from bench.dev.video_chunks import make_video
from epd.bench.compare import ServeProcess, cpu_set

ITEM = "44.7"
READY_S = 300
REQUEST_S = 120


def _data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 90, 40)).save(buf, "PNG")
    return buf.getvalue()


def _layout(ids: list[int], start: int, end: int, pads: set[int]) -> dict:
    """Each `<|vision_start|>`: does a run of pads follow, closed by `<|vision_end|>`?"""
    starts = [i for i, t in enumerate(ids) if t == start]
    runs = sum(1 for i, t in enumerate(ids) if t in pads and (i == 0 or ids[i - 1] != t))
    wrapped = 0
    for i in starts:
        j = i + 1
        while j < len(ids) and ids[j] in pads:
            j += 1
        wrapped += j > i + 1 and j < len(ids) and ids[j] == end
    return {"vision_starts": len(starts), "vision_ends": ids.count(end), "pad_runs": runs,
            "starts_that_open_a_pad_run": wrapped}


def probe_video_prompt(p: Probe, model_dir: str, out: Path) -> None:
    """Item 7: the served prompt of a chat with two videos and an image has one
    `<|vision_start|>...<|vision_end|>` per pad run (per Qwen3-VL temporal group,
    per Qwen2.5-VL video, per image) and no wrapper around a video's groups."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    start, end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>"))
    pads = {tokenizer.convert_tokens_to_ids(t) for t in ("<|video_pad|>", "<|image_pad|>")}
    clips = [make_video(11, 64, 96, fps=5, seed=1), make_video(8, 48, 64, fps=4, seed=2)]
    content = [{"type": "video_url", "video_url": {"url": _data_url(clips[0], "video/mp4")}},
               {"type": "image_url", "image_url": {"url": _data_url(_png(96, 64), "image/png")}},
               {"type": "video_url", "video_url": {"url": _data_url(clips[1], "video/mp4")}},
               {"type": "text", "text": "What happens?"}]
    out.mkdir(parents=True, exist_ok=True)
    server = ServeProcess(model_dir, "aggregated", cpu_set(None),
                          ["--limit-mm-per-prompt", '{"image": 1, "video": 2}'], out / "server-video-prompt.log")
    try:
        model = server.wait_ready(READY_S)
        began = time.monotonic()
        response = httpx.post(server.base_url + "/v1/chat/completions", timeout=REQUEST_S, json={
            "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2,
            "temperature": 0, "return_token_ids": True})
        seconds = round(time.monotonic() - began, 2)
        if response.status_code != 200:
            p.check(ITEM, "a chat with two videos and an image is answered", False,
                    {"status": response.status_code, "body": response.text[:300], "s": seconds})
            return
        body = response.json()
        ids = body["prompt_token_ids"]
        layout = _layout(ids, start, end, pads)
        saw = {"status": 200, "prompt_tokens": body["usage"]["prompt_tokens"], **layout, "s": seconds,
               "api_peak_rss_kib": _status_kib(server.proc.pid, "VmHWM")}
        p.check(ITEM, "every <|vision_start|> opens a pad run <|vision_end|> closes (no wrapper around a "
                      "video's groups)", layout["vision_starts"] == layout["pad_runs"]
                == layout["starts_that_open_a_pad_run"] == layout["vision_ends"], saw)
    finally:
        server.stop()


if __name__ == "__main__":
    import json
    import sys

    probe = Probe(Path(sys.argv[2] if len(sys.argv) > 2 else "bench-results/reliability-probe"))
    probe_video_prompt(probe, sys.argv[1], probe.out_dir)
    (probe.out_dir / "reliability_probe_video_prompt.json").write_text(json.dumps(probe.rows, indent=2))
    sys.exit(sum(not row["ok"] for row in probe.rows))
