"""`python -m bench.dev.video_chunks`: time to first token of one long video on an idle
e-p-d server, encoded whole on one encoder, then cut into chunks
(`--video-chunk-frames`) spread over 1, 2 and 4 encoders.

    python -m bench.dev.video_chunks MODEL_DIR --encoders 1,2,4 --frames 32 --size 224x224 --chunk-frames 4

Each configuration gets a fresh server (`epd serve --mode e-p-d --encoders N`,
its own cache dir), one warm-up video, then `--repeats` requests one at a time,
each with a video of its own (no embedding-cache hit), streamed with 1 output
token; TTFT is measured at the client (request sent -> first content delta).
The videos are made here with PyAV (mp4, a moving gradient plus noise) and
sampled whole (`mm_processor_kwargs` fps = the container's rate). HTTP only.
"""
from __future__ import annotations

import argparse
import io
import json
import statistics
import time
from pathlib import Path

import httpx
import numpy as np

from epd.bench.compare import ServeProcess, cpu_set
from epd.bench.datasets import data_url
from epd.bench.report import write_result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", help="checkpoint directory to serve")
    p.add_argument("--encoders", default="1,2,4", help="encoder counts, each a fresh server with chunks")
    p.add_argument("--chunk-frames", type=int, default=4, help="--video-chunk-frames of the chunked runs")
    p.add_argument("--frames", type=int, default=32, help="frames of each video (all sampled)")
    p.add_argument("--size", default="224x224", help="HEIGHTxWIDTH of the frames")
    p.add_argument("--fps", type=int, default=4, help="the container's frame rate")
    p.add_argument("--repeats", type=int, default=3, help="measured requests per configuration")
    p.add_argument("--cpus", default=None, help="CPU list the servers are pinned to (default: all)")
    p.add_argument("--server-args", default="", help="extra `epd serve` flags")
    p.add_argument("--output-dir", default="bench-results/video-chunks")
    p.add_argument("--seed", type=int, default=0)


def make_video(num_frames: int, height: int, width: int, fps: int, seed: int) -> bytes:
    """An mp4 whose frames all differ (a moving gradient plus noise)."""
    import av

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.height, stream.width, stream.pix_fmt = height, width, "yuv420p"
        for i in range(num_frames):
            frame = np.stack([(x * 3 + i * 23) % 256, (y * 5 + i * 41) % 256, (x + y + i * 67 + seed) % 256], -1)
            frame = ((frame + rng.integers(0, 24, frame.shape)) % 256).astype(np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return buf.getvalue()


def ttft_s(base_url: str, model: str, video: bytes, fps: int) -> float:
    """Seconds from sending one streamed chat with `video` to its first content delta."""
    body = {"model": model, "max_tokens": 1, "temperature": 0, "stream": True, "mm_processor_kwargs": {"fps": fps},
            "messages": [{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": data_url(video, "video/mp4")}},
                {"type": "text", "text": "What happens in the video?"}]}]}
    start = time.perf_counter()
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content") is not None:
                    return time.perf_counter() - start
    raise RuntimeError("the stream ended without a token")


def _measure(args, name: str, encoders: int, chunk_frames: int, out_dir: Path, seed: int) -> dict:
    height, width = map(int, args.size.lower().split("x"))
    extra = ["--encoders", str(encoders), "--video-chunk-frames", str(chunk_frames),
             "--mm-cache-dir", str(out_dir / f"cache-{name}"), *args.server_args.split()]
    server = ServeProcess(args.model_dir, "e-p-d", cpu_set(args.cpus), extra, out_dir / f"{name}.log")
    try:
        model = server.wait_ready()
        ttft_s(server.base_url, model, make_video(args.frames, height, width, args.fps, seed + 999), args.fps)
        ttfts = [ttft_s(server.base_url, model, make_video(args.frames, height, width, args.fps, seed + i), args.fps)
                 for i in range(args.repeats)]
    finally:
        server.stop()
    row = {"name": name, "encoders": encoders, "chunk_frames": chunk_frames,
           "median_ttft_ms": statistics.median(ttfts) * 1e3, "ttfts_ms": [t * 1e3 for t in ttfts]}
    print(f"{name:14s} encoders {encoders}  chunk frames {chunk_frames:3d}  median TTFT "
          f"{row['median_ttft_ms']:8.0f} ms  (each: {', '.join(f'{t * 1e3:.0f}' for t in ttfts)})", flush=True)
    return row


def main(args) -> dict:
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    configs = [("whole-1", 1, 0)] + [(f"chunks-{n}", int(n), args.chunk_frames)
                                     for n in args.encoders.split(",") if n]
    # every configuration sees the same videos: same seeds, a fresh server and cache each
    rows = [_measure(args, name, n, chunk, out_dir, args.seed) for name, n, chunk in configs]
    result = {"frames": args.frames, "size": args.size, "fps": args.fps, "repeats": args.repeats,
              "chunk_frames": args.chunk_frames, "cpus": sorted(cpu_set(args.cpus)), "rows": rows}
    write_result(out_dir / "video_chunks.json", result)
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.dev.video_chunks", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return parser


if __name__ == "__main__":
    main(build_parser().parse_args())
