"""GPU micro-benchmark of the paged decode attention kernel.

    python -m bench.dev.kernels [--peak-gbps 4800] [--batch-sizes 1,8,32,128] [--context-lens 1024,4096]

Times the Triton split-K decode kernel on a Qwen3-VL-4B-like layer (32 q heads,
8 kv heads, head_dim 128, bf16 by default) and the torch backend on the same
batch. Decode is memory bound, so the figure of merit is achieved bandwidth:
bytes of K/V read / kernel time, in GB/s and as a % of `--peak-gbps`
(default 4800, an H200's HBM3e). Times are medians of `triton.testing.do_bench`,
which clears the L2 cache before each run; they include the host-side launch
wherever that outlasts the kernel (small batches). `graph_us` replays the same
call from a CUDA graph (as a serving engine would): the kernels alone, without
launch overhead, but with the L2 cache warm (KV under ~60 MB may come from L2).
"""
from __future__ import annotations

import argparse
import sys

import torch

from epd.engine.attention.metadata import AttentionMetadata

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128  # Qwen3-VL-4B text layer
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.dev.kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--peak-gbps", type=float, default=4800.0, help="peak memory bandwidth, GB/s")
    parser.add_argument("--batch-sizes", default="1,8,32,128", help="comma-separated decode batch sizes")
    parser.add_argument("--context-lens", default="1024,4096", help="comma-separated tokens per sequence")
    parser.add_argument("--block-size", type=int, default=16, help="KV cache block size (tokens)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--num-splits", type=int, default=None, help="override the split-K heuristic")
    parser.add_argument("--no-torch", action="store_true", help="skip timing the torch backend")
    args = parser.parse_args(argv)
    try:
        args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
        args.context_lens = [int(x) for x in args.context_lens.split(",")]
    except ValueError:
        parser.error("--batch-sizes and --context-lens take comma-separated integers")
    if min(args.batch_sizes + args.context_lens) < 1 or args.peak_gbps <= 0:
        parser.error("batch sizes, context lengths and --peak-gbps must be positive")
    if args.block_size < 8 or args.block_size & (args.block_size - 1):
        parser.error("--block-size must be a power of two >= 8")
    return args


def kv_bytes(batch_size: int, context_len: int, dtype: torch.dtype) -> int:
    """Bytes of K and V one decode step reads."""
    return 2 * batch_size * context_len * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize


def make_decode_batch(batch_size: int, context_len: int, block_size: int, dtype: torch.dtype,
                      device: torch.device):
    """Full-length sequences on shuffled blocks: (query, k_cache, v_cache, meta)."""
    blocks_per_seq = -(-context_len // block_size)
    num_blocks = batch_size * blocks_per_seq
    block_tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(batch_size, blocks_per_seq)
    k_cache = torch.randn(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    query = torch.randn(batch_size, NUM_Q_HEADS, HEAD_DIM, dtype=dtype, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.full((batch_size,), -1, dtype=torch.int64, device=device),  # unused by attention
        cu_seqlens_q=torch.arange(batch_size + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch_size,), context_len, dtype=torch.int32, device=device),
        block_tables=block_tables,
        max_seqlen_q=1,
        max_seqlen_k=context_len,
        is_decode_only=True,
    )
    return query, k_cache, v_cache, meta


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.kernels times Triton kernels on a CUDA GPU, and torch.cuda.is_available() is False "
              "here; nothing to measure. (Kernel correctness on CPU: "
              "pytest tests/unit/engine/test_attention.py, which runs them under TRITON_INTERPRET=1.)",
              file=sys.stderr)
        return 1
    import triton.testing

    from epd.engine.attention import torch_attention
    from epd.engine.attention.triton_decode import choose_num_splits, paged_decode_attention

    device = torch.device("cuda")
    dtype = DTYPES[args.dtype]
    scale = HEAD_DIM ** -0.5
    print(f"# {torch.cuda.get_device_name(device)}, {args.dtype}, q heads {NUM_Q_HEADS}, kv heads {NUM_KV_HEADS}, "
          f"head_dim {HEAD_DIM}, block_size {args.block_size}, peak {args.peak_gbps:.0f} GB/s")
    header = (f"{'batch':>5} {'context':>7} {'splits':>6} {'triton_us':>10} {'GB/s':>7} {'%peak':>6}"
              f" {'graph_us':>9} {'GB/s':>7} {'%peak':>6}")
    if not args.no_torch:
        header += f" {'torch_us':>10} {'GB/s':>7} {'speedup':>7} {'max_err':>8}"
    print(header)
    for context_len in args.context_lens:
        for batch_size in args.batch_sizes:
            query, k_cache, v_cache, meta = make_decode_batch(batch_size, context_len, args.block_size,
                                                              dtype, device)
            num_splits = args.num_splits or choose_num_splits(batch_size * NUM_KV_HEADS, context_len, device)
            run_triton = lambda: paged_decode_attention(query, k_cache, v_cache, meta, scale,  # noqa: E731
                                                        num_splits=num_splits)
            triton_ms = triton.testing.do_bench(run_triton, return_mode="median")
            num_bytes = kv_bytes(batch_size, context_len, dtype)
            gbps = num_bytes / (triton_ms * 1e-3) / 1e9
            graph_ms = triton.testing.do_bench_cudagraph(run_triton, return_mode="median")
            graph_gbps = num_bytes / (graph_ms * 1e-3) / 1e9
            line = (f"{batch_size:>5} {context_len:>7} {num_splits:>6} {triton_ms * 1e3:>10.1f} "
                    f"{gbps:>7.0f} {100 * gbps / args.peak_gbps:>5.1f}% {graph_ms * 1e3:>9.1f} "
                    f"{graph_gbps:>7.0f} {100 * graph_gbps / args.peak_gbps:>5.1f}%")
            if not args.no_torch:
                run_torch = lambda: torch_attention.attention(query, k_cache, v_cache, meta, scale)  # noqa: E731
                max_err = (run_triton().float() - run_torch().float()).abs().max().item()
                torch_ms = triton.testing.do_bench(run_torch, return_mode="median")
                torch_gbps = num_bytes / (torch_ms * 1e-3) / 1e9
                line += (f" {torch_ms * 1e3:>10.1f} {torch_gbps:>7.0f} {torch_ms / triton_ms:>6.1f}x"
                         f" {max_err:>8.1e}")
            print(line, flush=True)
            del query, k_cache, v_cache, meta
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
