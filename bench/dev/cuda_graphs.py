"""CUDA graphs for decode steps and first-use stalls, on a GPU (issue 29).

    python -m bench.dev.cuda_graphs throughput MODEL [--dtype bfloat16] [--concurrency 1,8,32,128]
    python -m bench.dev.cuda_graphs stall MODEL [--num-requests 220] [--enforce-eager] [--no-warm-up]

`throughput`: the offline workload of `epd bench offline` (random prompts,
EOS ignored) through `LLM` eagerly (`enforce_eager=True`) and with graphs,
one engine after the other in this process: output tokens/s at each
concurrency, ms per output token at C=1, the start-up (load, KV sizing,
kernel warm-up, capture) and whether both gave the same greedy tokens.

`stall`: run in a fresh process with an empty Triton cache (as a server's
first start on a machine): requests arrive a few at a time with prompts of
8-700 tokens, so steps take many shapes; each step's wall time is charged
to the requests that decoded in it. Prints the largest gap between two
tokens of the first 20 requests against the P99 and largest of the rest.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time


def _engine(args, max_num_seqs: int, eager: bool):
    from epd import LLM

    started = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, kv_cache_gb=8, max_num_seqs=max_num_seqs, enforce_eager=eager)
    return llm, time.perf_counter() - started


def throughput(args) -> dict:
    import torch

    from epd.bench.offline import _workload, bench_epd
    from epd.transport.wire.sampling import SamplingParams

    levels = [int(c) for c in args.concurrency.split(",")]
    result = {"dtype": args.dtype, "input_len": args.input_len, "output_len": args.output_len, "modes": {}}
    tokens = {}
    for mode in ("eager", "graphs"):
        llm, start_s = _engine(args, max(levels), eager=mode == "eager")
        row = {"start_s": round(start_s, 2), "capture_s": llm.engine.graph_capture_s, "tok_s": {}}
        for c in levels:
            prompts, lens = _workload(llm.tokenizer, c, args.input_len, args.output_len, 0.0, seed=c)
            row["tok_s"][c] = round(bench_epd(llm, prompts, lens), 1)
        prompts, _ = _workload(llm.tokenizer, 8, args.input_len, 0, 0.0, seed=99)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True))
        tokens[mode] = [o.outputs[0].token_ids for o in outs]
        if llm.engine.runner.graphs is not None:
            row["replays"] = llm.engine.runner.graphs.num_replays
        result["modes"][mode] = row
        print(mode, json.dumps(row), flush=True)
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    result["same_greedy_tokens"] = sum(a == b for a, b in zip(tokens["eager"], tokens["graphs"]))
    result["greedy_common_prefix"] = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                                      for a, b in zip(tokens["eager"], tokens["graphs"])]
    result["ratio"] = {c: round(result["modes"]["graphs"]["tok_s"][c] / result["modes"]["eager"]["tok_s"][c], 2)
                       for c in levels}
    if 1 in levels:
        result["ms_per_token_c1"] = {m: round(1000 / r["tok_s"][1], 2) for m, r in result["modes"].items()}
    return result


def stall(args) -> dict:
    from epd.engine.request import Request
    from epd.transport.wire.sampling import SamplingParams

    if args.no_warm_up:  # as before the warm-up existed: kernels compile on their first use
        from epd.engine.attention import triton_attention

        triton_attention.prepare = lambda k_cache, num_q_heads: None
    compiles: list[tuple[int, str]] = []  # (step, kernel): Triton compiling after start-up
    step_s: list[float] = []
    llm, start_s = _engine(args, 64, eager=args.enforce_eager)
    _on_compile(lambda repr_: compiles.append((len(step_s), repr_.split("[")[0])))
    engine = llm.engine
    rng = random.Random(0)
    vocab = len(llm.tokenizer)
    waiting = [Request(request_id=str(i), prompt_token_ids=[rng.randrange(300, vocab) for _ in range(rng.randint(8, 700))],
                       sampling_params=SamplingParams(temperature=0, max_tokens=rng.randint(8, 64), ignore_eos=True))
               for i in range(args.num_requests)]
    waiting.reverse()
    last_token_at: dict[str, float] = {}
    gaps: dict[int, float] = {}  # request index -> its largest gap between two tokens (s)
    shapes: list[tuple[int, int]] = []  # per step: (tokens, sequences)
    while waiting or engine.has_unfinished():
        for _ in range(rng.choice((0, 0, 1, 1, 2, 3))):
            if waiting:
                engine.add_request(waiting.pop())
        if not engine.has_unfinished():
            continue
        started = time.perf_counter()
        result = engine.step()
        now = time.perf_counter()
        step_s.append(now - started)
        shapes.append((result.num_batched_tokens, len(result.requests)))
        for update in result.updates:
            rid = update.request_id
            if update.new_token_ids and rid in last_token_at:
                gaps[int(rid)] = max(gaps.get(int(rid), 0.0), now - last_token_at[rid])
            if update.new_token_ids:
                last_token_at[rid] = now
    first = [gaps[i] for i in range(20) if i in gaps]
    rest = sorted(gaps[i] for i in gaps if i >= 20)
    ms = lambda s: round(1000 * s, 1)  # noqa: E731
    mode = ("eager" if args.enforce_eager else "graphs") + (", no warm-up" if args.no_warm_up else "")
    return {"mode": mode, "start_s": round(start_s, 2),
            "capture_s": engine.graph_capture_s, "steps": len(step_s),
            "first_20_max_gap_ms": ms(max(first)), "rest_p99_gap_ms": ms(rest[int(0.99 * (len(rest) - 1))]),
            "rest_max_gap_ms": ms(max(rest)), "step_median_ms": ms(statistics.median(step_s)),
            "step_max_ms": ms(max(step_s)), "replays": getattr(engine.runner.graphs, "num_replays", 0),
            "slowest_steps": [{"step": i, "ms": ms(step_s[i]), "tokens": shapes[i][0], "seqs": shapes[i][1]}
                              for i in sorted(range(len(step_s)), key=step_s.__getitem__)[-5:]],
            "compiles_after_start": compiles}


def _on_compile(record) -> None:
    """Calls record(kernel signature) whenever Triton compiles a kernel from now on."""
    try:
        from triton import knobs
    except ImportError:  # an older Triton: not reported
        return

    def hook(*, repr, **_):  # noqa: A002 (Triton's keyword)
        record(repr)
        return False  # go on compiling

    knobs.runtime.jit_cache_hook = hook


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.dev.cuda_graphs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["throughput", "stall"])
    p.add_argument("model")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda", help="cuda (cpu: a smoke run, no graphs there)")
    p.add_argument("--concurrency", default="1,8,32,128")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-requests", type=int, default=220)
    p.add_argument("--enforce-eager", action="store_true", help="stall: without graphs")
    p.add_argument("--no-warm-up", action="store_true", help="stall: skip the kernels' warm-up at start-up")
    p.add_argument("--save-result", default=None)
    args = p.parse_args(argv)
    if args.what == "stall" and "TRITON_CACHE_DIR" not in os.environ:  # a first start: nothing compiled yet
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-")
    result = throughput(args) if args.what == "throughput" else stall(args)
    print(json.dumps(result, indent=1), flush=True)
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
