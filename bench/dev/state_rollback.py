"""Rolling a Gated DeltaNet layer's state back after a rejected draft: per-position checkpoints
against recompute, CPU time of one verify step of one layer.

    python -m bench.dev.state_rollback [--seqs 1 8] [--draft 3] [--shape 35b-a3b|tiny]

Verifying d draft tokens runs d + 1 positions of each sequence through the layer, token by token
with the recurrent rule (as decoding does); the target then accepts a of the d drafts, and the
slot must hold the state after position a. The two ways, each from the same slots and inputs:

    checkpoints  keep the (conv, recurrent) state after every position but the last (the slot
                 holds that one), then copy position a's into the slot when a < d (engine/layers/gated_deltanet.py, engine/state_cache.py)
    recompute    copy the slots' states before the step; when a < d, restore them and rerun the
                 conv and the recurrent rule over positions 0..a from the step's saved inputs

Prints CPU microseconds per step (one torch thread, best of 5, less the copy that resets the
states between runs) for each a in 0..d, and both
ways' largest difference from one-token-at-a-time decoding of the accepted tokens (must be 0).
The `35b-a3b` shape is Qwen3.5-35B-A3B's linear layer (16 key / 32 value heads of 128, conv 4).
"""
from __future__ import annotations

import argparse
import time

import torch

from epd.engine.layers.causal_conv1d import causal_conv1d_decode
from epd.engine.layers.gated_delta import recurrent_gated_delta_rule

SHAPES = {"35b-a3b": (16, 32, 128, 128, 4), "tiny": (2, 4, 16, 16, 4)}  # k heads, v heads, k_dim, v_dim, kernel


def inputs(num_seqs: int, num_positions: int, shape):
    hk, hv, dk, dv, kernel = shape
    conv_dim = 2 * hk * dk + hv * dv
    gen = torch.Generator().manual_seed(0)
    mixed = torch.randn(num_seqs, num_positions, conv_dim, generator=gen)
    g = -torch.rand(num_seqs, num_positions, hv, generator=gen)
    beta = torch.rand(num_seqs, num_positions, hv, generator=gen)
    weight = torch.randn(conv_dim, kernel, generator=gen) * 0.3
    conv = torch.randn(num_seqs, conv_dim, kernel - 1, generator=gen)
    rec = torch.randn(num_seqs, hv, dk, dv, generator=gen) * 0.1
    return mixed, g, beta, weight, conv, rec


def split(x: torch.Tensor, shape):
    hk, hv, dk, dv, _ = shape
    q, k, v = x.split([hk * dk, hk * dk, hv * dv], dim=-1)
    return q.reshape(-1, hk, dk), k.reshape(-1, hk, dk), v.reshape(-1, hv, dv)


def step(j: int, mixed, g, beta, weight, conv, rec, shape) -> None:
    """Position j of every sequence, in place on conv and rec (the layer's token-by-token loop)."""
    q, k, v = split(causal_conv1d_decode(mixed[:, j], weight, conv), shape)
    recurrent_gated_delta_rule(q, k, v, g[:, j], beta[:, j], rec)


def with_checkpoints(num_accepted: int, mixed, g, beta, weight, conv, rec, shape):
    num_positions = mixed.shape[1]
    conv_ck = conv.new_empty(conv.shape[0], num_positions - 1, *conv.shape[1:])  # the last one: the slot's
    rec_ck = rec.new_empty(rec.shape[0], num_positions - 1, *rec.shape[1:])
    for j in range(num_positions):
        step(j, mixed, g, beta, weight, conv, rec, shape)
        if j < num_positions - 1:
            conv_ck[:, j], rec_ck[:, j] = conv, rec
    if num_accepted < num_positions - 1:
        conv.copy_(conv_ck[:, num_accepted])
        rec.copy_(rec_ck[:, num_accepted])


def with_recompute(num_accepted: int, mixed, g, beta, weight, conv, rec, shape):
    num_positions = mixed.shape[1]
    before = conv.clone(), rec.clone()
    for j in range(num_positions):
        step(j, mixed, g, beta, weight, conv, rec, shape)
    if num_accepted < num_positions - 1:
        conv.copy_(before[0])
        rec.copy_(before[1])
        for j in range(num_accepted + 1):
            step(j, mixed, g, beta, weight, conv, rec, shape)


def reference(num_accepted: int, mixed, g, beta, weight, conv, rec, shape):
    for j in range(num_accepted + 1):
        step(j, mixed, g, beta, weight, conv, rec, shape)


def cpu_us(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(5):
        t = time.process_time()
        for _ in range(reps):
            fn()
        best = min(best, (time.process_time() - t) / reps * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--draft", type=int, default=3, help="draft tokens d (d + 1 positions verified)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="35b-a3b")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shape = SHAPES[args.shape]
    print(f"shape {args.shape} {shape}, d={args.draft}; CPU us per verify step of one layer")
    print(f"{'seqs':>5} {'accepted':>8} {'checkpoints':>12} {'recompute':>10} {'max |diff|':>10}")
    with torch.inference_mode():
        for num_seqs in args.seqs:
            mixed, g, beta, weight, conv0, rec0 = inputs(num_seqs, args.draft + 1, shape)
            reps = max(2, 16 // num_seqs)
            for a in range(args.draft + 1):
                times, diff = [], 0.0
                want = conv0.clone(), rec0.clone()
                reference(a, mixed, g, beta, weight, *want, shape)
                for way in (with_checkpoints, with_recompute):
                    conv, rec = conv0.clone(), rec0.clone()
                    way(a, mixed, g, beta, weight, conv, rec, shape)
                    diff = max(diff, float((conv - want[0]).abs().max()), float((rec - want[1]).abs().max()))
                    def run(way=way):  # from the same states each time: copied into the work buffers
                        conv.copy_(conv0), rec.copy_(rec0)
                        way(a, mixed, g, beta, weight, conv, rec, shape)
                    times.append(cpu_us(run, reps) - cpu_us(lambda: (conv.copy_(conv0), rec.copy_(rec0)), reps))
                print(f"{num_seqs:>5} {a:>8} {times[0]:>12.0f} {times[1]:>10.0f} {diff:>10.1e}")


if __name__ == "__main__":
    main()
