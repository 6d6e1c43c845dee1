"""The CPU GEMM behind every projection: torch's `F.linear` (MKL in the x86
wheels) against oneDNN with a packed weight (`transport/weights/cpu_linear.PackedLinear`,
what the engine and the vision tower run on CPU in float32), issue 32.

    python -m bench.dev.cpu_linear [--threads 1] [--rows 1,8,32,128] [--hidden 768 --intermediate 2304 --vocab 8192]

For each row count M, the five projections of one decoder layer of the given
shape plus the output head (qkv, o, gate_up, down, lm_head), timed in turns
(plain, packed, plain, packed, ...) so that a neighbour's load hits both; CPU
time of this process (`time.process_time`), which a loaded machine inflates far
less than wall time. Prints one JSON line per M and a table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from epd.transport.weights.cpu_linear import PackedLinear


def layer_shapes(hidden: int, intermediate: int, vocab: int, q: int, kv: int) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's projections and the output head."""
    return [(hidden, q + 2 * kv), (q, hidden), (hidden, 2 * intermediate), (intermediate, hidden), (hidden, vocab)]


def _cpu_us(fn, reps: int) -> float:
    start = time.process_time()
    for _ in range(reps):
        fn()
    return (time.process_time() - start) / reps * 1e6


def measure(rows: int, shapes: list[tuple[int, int]], reps: int, turns: int) -> dict:
    plain, packed = [], []
    layers = [nn.Linear(i, o, bias=False) for i, o in shapes]
    packs = [PackedLinear(lin) for lin in layers]
    inputs = [torch.randn(rows, i) for i, _ in shapes]
    with torch.inference_mode():
        for _ in range(turns):
            plain.append(sum(_cpu_us(lambda: F.linear(x, lin.weight), reps) for x, lin in zip(inputs, layers)))
            packed.append(sum(_cpu_us(lambda: p(x), reps) for x, p in zip(inputs, packs)))
    return {"rows": rows, "torch_linear_us": statistics.median(plain), "onednn_packed_us": statistics.median(packed),
            "speedup": statistics.median(plain) / statistics.median(packed),
            "max_abs_diff": max((F.linear(x, lin.weight) - p(x)).abs().max().item()
                                for x, lin, p in zip(inputs, layers, packs))}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", default="1,8,32,128")
    p.add_argument("--hidden", type=int, default=768)  # the `small` preset's shapes
    p.add_argument("--intermediate", type=int, default=2304)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--q", type=int, default=768)
    p.add_argument("--kv", type=int, default=256)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--turns", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = layer_shapes(args.hidden, args.intermediate, args.vocab, args.q, args.kv)
    print(f"{args.threads} thread(s); one layer's projections + head {shapes}; CPU us, median of {args.turns} turns")
    print("| rows | torch F.linear us | oneDNN packed us | speedup | max abs diff |")
    print("|---:|---:|---:|---:|---:|")
    for rows in (int(r) for r in args.rows.split(",")):
        r = measure(rows, shapes, args.reps, args.turns)
        print(f"| {rows} | {r['torch_linear_us']:.0f} | {r['onednn_packed_us']:.0f} | {r['speedup']:.2f} "
              f"| {r['max_abs_diff']:.1e} |")
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
