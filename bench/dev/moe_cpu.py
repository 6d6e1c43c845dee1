"""The routed experts of one MoE layer on CPU, before and after: the per-expert loop as it was
(a gather, two linears and an index_add per expert) against `run_experts` with plain linears
(`fused_moe_torch`) and with oneDNN-packed experts (`PackedExperts`), at decode- and prefill-sized
batches, float32 and bfloat16; the largest difference to the old loop alongside.

    python -m bench.dev.moe_cpu [--threads 2] [--experts 16 --top-k 4 --hidden 768 --inter 384]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from epd.engine.layers.moe import PackedExperts, fused_moe_torch, route, run_experts, sort_by_expert


def loop_per_expert(x, w13, w2, topk_weights, topk_ids):
    """The loop before `run_experts`: a gather and an index_add per expert."""
    num_experts, top_k, inter = w13.shape[0], topk_ids.shape[1], w2.shape[2]
    pairs, counts = sort_by_expert(topk_ids, num_experts)
    flat_weights = topk_weights.flatten()
    out = torch.zeros_like(x)
    start = 0
    for expert, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        rows = pairs[start:start + n]
        start += n
        tokens = rows // top_k
        h = F.linear(x[tokens], w13[expert])
        y = F.linear(F.silu(h[:, :inter]) * h[:, inter:], w2[expert])
        out.index_add_(0, tokens, y * flat_weights[rows, None])
    return out


def time_ms(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--inter", type=int, default=384)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    e, h, i = args.experts, args.hidden, args.inter
    print(f"{e} experts (top {args.top_k}), hidden {h}, intermediate {i}, {args.threads} threads; ms per layer")
    for dtype in (torch.bfloat16, torch.float32):
        w13, w2 = (torch.randn(e, 2 * i, h) * 0.03).to(dtype), (torch.randn(e, h, i) * 0.03).to(dtype)
        router = (torch.randn(e, h) * 0.03).to(dtype)
        packed = PackedExperts(w13, w2)
        for n in args.tokens:
            x = torch.randn(n, h).to(dtype)
            weights, ids = route(x @ router.t(), args.top_k, True)
            old = loop_per_expert(x, w13, w2, weights, ids)
            runs = {"old loop": lambda: loop_per_expert(x, w13, w2, weights, ids),
                    "run_experts": lambda: fused_moe_torch(x, w13, w2, weights, ids),
                    "packed": lambda: run_experts(x, weights, ids, e, packed)}
            cells = []
            for name, fn in runs.items():
                diff = (fn() - old).abs().max().item()
                cells.append(f"{name} {time_ms(fn, args.repeats):7.2f} (diff {diff:.1e})")
            print(f"{str(dtype)[6:]:8s} {n:4d} tokens: " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
