"""The collectives of one tensor-parallel decode step on CPU (engine/parallel/comm.py), alone:
per step of B sequences, 2 all-reduces of [B, hidden] per layer (after o_proj and down_proj), one
for the embedding, and the head's gather of [B, ceil(vocab / N)] float32; the median µs per step,
the all-reduces through gloo and through shared memory (shm_allreduce.py), interleaved.
With --offline, also the offline LLM's decode tokens/s at TP=1 and TP=N on the same checkpoint.

    python -m bench.dev.tp_allreduce [--preset small] [--size 2] [--batches 1 8 32] [--offline DIR]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from epd.engine.parallel import shm_allreduce
from epd.engine.parallel.comm import GroupComm, open_store

PRESETS = {"tiny": (3, 64, 1024), "small": (14, 768, 151_936)}  # num_layers, hidden, vocab (as make-model's)


def run_rank(run_dir: str, rank: int, size: int, preset: str, batches: list[int], steps: int) -> None:
    torch.set_num_threads(1)
    comm = GroupComm.connect(open_store(run_dir, size, 60), rank, size, 60)
    shm = shm_allreduce.ShmAllReduce(shm_allreduce.shm_path(run_dir), rank, size, shm_allreduce.SLOT_BYTES, 60)
    num_layers, hidden, vocab = PRESETS[preset]
    for b, kind in [(b, kind) for b in batches for kind in ("gloo", "shm", "gloo", "shm")]:
        comm.shm = shm if kind == "shm" else None
        x, logits = torch.randn(b, hidden), torch.randn(b, -(-vocab // size))
        reduces, gathers = [], []
        for _ in range(steps):
            start = time.perf_counter()
            for _ in range(2 * num_layers + 1):
                comm.all_reduce(x)
            middle = time.perf_counter()
            comm.gather(logits)
            reduces.append(middle - start)
            gathers.append(time.perf_counter() - middle)
        if rank == 0:
            r, g = statistics.median(reduces) * 1e6, statistics.median(gathers) * 1e6
            print(f"{preset} TP={size} B={b:3d} {kind}: {2 * num_layers + 1} all-reduces [B, {hidden}] {r:7.0f} µs "
                  f"({r / (2 * num_layers + 1):4.0f} each) + gather [B, {-(-vocab // size)}] {g:7.0f} µs "
                  "per decode step", flush=True)


def offline(model_dir: str, size: int, batch: int, max_tokens: int) -> None:
    from epd import LLM
    from epd.transport.wire.sampling import SamplingParams

    prompts = [[{"role": "user", "content": f"Story number {i}, please."}] for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for tp in (1, size):
        llm = LLM(model_dir, dtype="float32", device="cpu", tensor_parallel_size=tp)
        llm.chat(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4))  # warm up
        start = time.perf_counter()
        llm.chat(prompts, params)
        seconds = time.perf_counter() - start
        print(f"offline TP={tp}: {batch} x {max_tokens} tokens in {seconds:.2f} s = "
              f"{batch * max_tokens / seconds:.0f} tokens/s", flush=True)
        if tp > 1:
            llm.engine.runner.model.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", choices=list(PRESETS))
    p.add_argument("--size", type=int, default=2)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--offline", metavar="DIR", help="also time the offline LLM on this checkpoint")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is not None:
        run_rank(args.run_dir, args.rank, args.size, args.preset, args.batches, args.steps)
        return
    run_dir = tempfile.mkdtemp(prefix="epd-tp-bench-")
    shm_file = shm_allreduce.create(run_dir, args.size, shm_allreduce.SLOT_BYTES)
    argv = [sys.executable, "-m", "bench.dev.tp_allreduce", "--preset", args.preset, "--size", str(args.size),
            "--steps", str(args.steps), "--run-dir", run_dir, "--batches", *map(str, args.batches)]
    ranks = [subprocess.Popen([*argv, "--rank", str(r)]) for r in range(args.size)]
    for proc in ranks:
        proc.wait()
    shm_file.unlink()
    if args.offline:
        offline(args.offline, args.size, 8, 64)


if __name__ == "__main__":
    main()
