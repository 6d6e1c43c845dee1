"""CPU time of the torch backend's paged decode attention: the CPU kernel against gather + SDPA (issue 32).

    python -m bench.dev.cpu_decode_attention [--threads 1,2] [--rounds 7] [--batch-mb 4]

One decode step's attention over every layer of the `small` preset (14 layers, 12 q / 4 kv
heads of 64, float32, blocks of 16 shuffled over a 4,500-block cache) for decode batches of
8-128 sequences of 20-2,000 tokens. The first setting is the gather + SDPA path with the
first batch cap (`_DECODE_BATCH_MAX_BYTES`) and its kept gather buffers; then the same cap
with a new tensor each gather (`_MAX_KEPT_BUFFER_BYTES` 0), any other caps, and the CPU
kernel (engine/attention/paged_attention_cpu.c, K and V read in place), and the kernel over the
same K and V in an fp8 e4m3 cache (`--kv-cache-dtype fp8`: engine/attention/fp8_kv.py). Rounds run every
setting in turn; each line gives the first setting's median ms a step and every other's
median ratio to it in the same round (these machines are noisy: compare within a round).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from epd.engine.attention import cpu_kernel, fp8_kv, torch_attention
from epd.engine.attention.metadata import AttentionMetadata

LAYERS, CACHE_BLOCKS, BLOCK, KV_HEADS, Q_HEADS, HEAD_DIM = 14, 4500, 16, 4, 12, 64
BATCHES = [(32, 280, 400), (128, 20, 80), (8, 1000, 2000), (128, 280, 400), (32, 20, 800)]


def decode_batch(num_seqs: int, shortest: int, longest: int, rng: random.Random):
    """A one-token decode for each of `num_seqs` sequences of random length, blocks shuffled."""
    free = list(range(1, CACHE_BLOCKS))
    rng.shuffle(free)
    lens = [rng.randint(shortest, longest) for _ in range(num_seqs)]
    tables = []
    for n in lens:
        tables.append([free.pop() for _ in range(-(-n // BLOCK))])
    meta = AttentionMetadata.build([1] * num_seqs, lens, tables, BLOCK)
    return torch.randn(num_seqs, Q_HEADS, HEAD_DIM), meta


def step_seconds(query, meta, caches, batch_bytes: int, keep_bytes: int, kernel: bool) -> float:
    torch_attention._DECODE_BATCH_MAX_BYTES = batch_bytes
    torch_attention._MAX_KEPT_BUFFER_BYTES = keep_bytes
    torch_attention.use_cpu_kernel = kernel
    meta.plans.clear()
    torch_attention.attention(query, *caches[0], meta, 0.125)  # the plan, and the buffers grown
    start = time.perf_counter()
    for k_cache, v_cache in caches:
        torch_attention.attention(query, k_cache, v_cache, meta, 0.125)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.dev.cpu_decode_attention",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2", help="torch threads, comma-separated")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch-mb", default="4", help="gather + SDPA batch caps (MiB of K), comma-separated")
    args = parser.parse_args(argv)
    if cpu_kernel.load() is None:
        parser.error("the CPU kernel did not build (see the warning above)")
    kept = torch_attention._MAX_KEPT_BUFFER_BYTES
    caps = [int(mb) << 20 for mb in args.batch_mb.split(",")]
    settings = {f"{cap >> 20} MiB, kept buffers": (cap, kept, False) for cap in caps}
    settings[f"{caps[0] >> 20} MiB, fresh buffers"] = (caps[0], 0, False)
    settings["CPU kernel"] = (caps[0], kept, True)
    settings["CPU kernel, fp8 cache"] = (caps[0], kept, True, "fp8")
    torch.manual_seed(0)
    caches = [(torch.randn(CACHE_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM), torch.randn(CACHE_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM))
              for _ in range(LAYERS)]
    fp8_caches = [tuple(fp8_kv.quantize(c, torch.float8_e4m3fn) for c in pair) for pair in caches]
    names = list(settings)
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        print(f"--- {threads} thread(s); ms a step for '{names[0]}', then each setting / it")
        for num_seqs, shortest, longest in BATCHES:
            query, meta = decode_batch(num_seqs, shortest, longest, random.Random(0))
            times = {name: [] for name in names}
            for _ in range(args.rounds):
                for name in names:
                    cap, keep, kernel, *fp8 = settings[name]
                    times[name].append(step_seconds(query, meta, fp8_caches if fp8 else caches, cap, keep, kernel))
            base = times[names[0]]
            ratios = "  ".join(f"{name}: {statistics.median(t / b for t, b in zip(times[name], base)):.2f}"
                               for name in names[1:])
            print(f"{num_seqs} seqs of {shortest}-{longest} tokens: {1000 * statistics.median(base):.1f} ms  {ratios}")


if __name__ == "__main__":
    main()
