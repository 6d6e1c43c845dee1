"""`epd bench offline`: engine throughput against transformers, same machine, one run.

For each concurrency C (default 1, 8, 32), C text requests run through
the engines below, with EOS ignored so every request produces exactly its
own output length. Lengths are drawn uniformly from
[L(1-r), L(1+r)] for prompts and outputs (`--range-ratio r`, as vLLM's
random dataset; r=0 gives equal lengths, static batching's best case):
  * epd    — our engine (`LLM.generate`, continuous batching, paged KV);
  * hf-1   — transformers `generate` one request at a time;
  * hf-pad — transformers `generate` on static left-padded batches of C; a
             batch runs until its longest output, and only each request's own
             tokens count.
Output tokens/s are reported per engine, plus, at C=1, our time per output
token against one bare decode forward step of our model (the floor).
`--device cuda --dtype bfloat16` runs both engines on a GPU (our attention
then uses the Triton kernels).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def _workload(tokenizer, num: int, input_len: int, output_len: int, range_ratio: float,
              seed: int) -> tuple[list[list[int]], list[int]]:
    """(prompts as token ids, output lengths), seeded."""
    import random

    rng = random.Random(seed)
    low, high = 300, len(tokenizer)  # stay clear of the special tokens at the start of the vocab

    def length(n: int) -> int:
        return max(1, rng.randint(round(n * (1 - range_ratio)), round(n * (1 + range_ratio))))

    prompts = [[rng.randrange(low, high) for _ in range(length(input_len))] for _ in range(num)]
    return prompts, [length(output_len) for _ in range(num)]


def bench_epd(llm, prompts, output_lens: list[int], json_schema: dict | None = None) -> float:
    """Output tokens/s; with `json_schema` every request is constrained to it (structured outputs)."""
    from epd.transport.wire.sampling import SamplingParams, StructuredOutputsParams

    so = StructuredOutputsParams(json=json_schema) if json_schema is not None else None
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, structured_outputs=so)
              for n in output_lens]
    # warm-up on a prompt the run does not contain: the run must find nothing in the prefix cache
    # (and, constrained, the schema is compiled before the clock starts)
    llm.generate([prompts[0][::-1]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True,
                                                    structured_outputs=so))
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == output_lens
    return sum(output_lens) / elapsed


def bench_hf(hf_model, prompts, output_lens: list[int], batch_size: int, pad_id: int) -> float:
    """transformers generate on static left-padded batches (batch_size 1 = one at a time).
    A batch generates its longest output; only each request's own tokens count."""
    import torch

    @torch.inference_mode()
    def run(batch, new_tokens: int):
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=hf_model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=hf_model.device)
        out = hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id)
        assert out.shape[1] - width == new_tokens
    run(prompts[:1], 2)  # warm-up
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        run(prompts[i:i + batch_size], max(output_lens[i:i + batch_size]))
    _synchronize(hf_model.device)
    elapsed = time.perf_counter() - start
    return sum(output_lens) / elapsed


def bare_decode_step_s(llm, context_len: int, repeats: int = 20) -> float:
    """Median time of one decode forward of our model alone (no scheduler,
    no sampler): one token attending to `context_len` cached tokens."""
    import torch

    from epd.engine.attention.metadata import AttentionMetadata
    from epd.engine.layers.forward_batch import ForwardBatch

    runner = llm.engine.runner
    block_size = runner.block_size
    num_blocks = context_len // block_size + 1
    blocks = list(range(num_blocks))
    meta = AttentionMetadata.build([1], [context_len], [blocks], block_size, device=runner.device)
    rows = runner.positions.position_dims  # the model's (engine/models/positions.py)
    batch = ForwardBatch(positions=torch.full((rows, 1), context_len - 1, device=runner.device), attn_meta=meta,
                         backend=runner.backend, kv_caches=runner.kv_caches)
    ids = torch.tensor([100], device=runner.device)
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 3):
            start = time.perf_counter()
            hidden = runner.model(ids, batch)
            runner.model.compute_logits(hidden)
            _synchronize(runner.device)
            times.append(time.perf_counter() - start)
    return statistics.median(times[3:])


def _synchronize(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


MATMUL_OPS = ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise")


def matmul_seconds(fn) -> float:
    """CPU seconds `fn()` spends in the weight matmuls (aten::mm/addmm; on CPU in float32 the
    engine's are oneDNN's packed `mkldnn::_linear_pointwise`, transport/weights/cpu_linear.py), by torch's profiler."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in MATMUL_OPS) / 1e6


def main(args) -> dict:
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from epd.llm import LLM

    if args.matmul_floor and args.device != "cpu":
        raise SystemExit("epd bench offline: --matmul-floor profiles CPU matmuls; use it with --device cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_num_seqs=max(args.concurrency),
              max_num_batched_tokens=args.max_num_batched_tokens)
    # transformers' class of the checkpoint's family (Qwen3-VL, Qwen3-VL-MoE, Qwen2.5-VL)
    hf = AutoModelForImageTextToText.from_pretrained(args.model, dtype=llm.engine.dtype)
    hf = hf.to(llm.engine.device).eval()
    pad_id = tokenizer.pad_token_id or 0
    rows = []
    for c in args.concurrency:
        prompts, output_lens = _workload(tokenizer, c, args.input_len, args.output_len, args.range_ratio, seed=c)
        row = {"concurrency": c, "epd_tok_s": bench_epd(llm, prompts, output_lens, args.json_schema)}
        k = min(c, args.hf_sequential_max)  # one at a time: the rate does not depend on C
        row["hf_sequential_tok_s"] = bench_hf(hf, prompts[:k], output_lens[:k], 1, pad_id)
        row["hf_static_batch_tok_s"] = bench_hf(hf, prompts, output_lens, c, pad_id)
        row["vs_hf_sequential"] = row["epd_tok_s"] / row["hf_sequential_tok_s"]
        row["vs_hf_static_batch"] = row["epd_tok_s"] / row["hf_static_batch_tok_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.matmul_floor:
        # The same matmuls in both engines: if transformers' static batch finishes in
        # less than 1.5x our matmul time, no attention or scheduler work can reach 1.5x.
        c = rows[-1]["concurrency"]  # `prompts` and `output_lens` are still the loop's last workload
        # new first tokens: the engine's prefix cache still holds the measured run's prompts
        fresh = [[p[0] ^ 1] + p[1:] for p in prompts]
        epd_mm = matmul_seconds(lambda: bench_epd(llm, fresh, output_lens))
        hf_mm = matmul_seconds(lambda: bench_hf(hf, prompts, output_lens, c, pad_id))
        hf_wall = sum(output_lens) / rows[-1]["hf_static_batch_tok_s"]
        rows[-1].update({"epd_matmul_s": epd_mm, "hf_static_batch_matmul_s": hf_mm,
                         "hf_static_batch_wall_s": hf_wall, "ceiling_vs_hf_static_batch": hf_wall / epd_mm})
        print(json.dumps(rows[-1]), flush=True)
    step_s = bare_decode_step_s(llm, args.input_len + args.output_len // 2)
    tpot_s = 1.0 / rows[0]["epd_tok_s"] if rows[0]["concurrency"] == 1 else float("nan")
    result = {"model": args.model, "device": str(llm.engine.device), "dtype": str(llm.engine.dtype),
              "threads": args.threads, "input_len": args.input_len,
              "output_len": args.output_len, "range_ratio": args.range_ratio, "json_schema": args.json_schema,
              "rows": rows, "bare_decode_step_ms": step_s * 1e3,
              "epd_tpot_ms_at_1": tpot_s * 1e3, "tpot_over_bare_step": tpot_s / step_s}
    _print_table(result)
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=2)
    return result


def _print_table(result: dict) -> None:
    print(f"\n{'C':>4} {'epd tok/s':>10} {'hf-1 tok/s':>11} {'hf-pad tok/s':>13} {'x hf-1':>7} {'x hf-pad':>9}")
    for r in result["rows"]:
        print(f"{r['concurrency']:>4} {r['epd_tok_s']:>10.1f} {r['hf_sequential_tok_s']:>11.1f} "
              f"{r['hf_static_batch_tok_s']:>13.1f} {r['vs_hf_sequential']:>7.2f} {r['vs_hf_static_batch']:>9.2f}")
    last = result["rows"][-1]
    if "epd_matmul_s" in last:
        print(f"C={last['concurrency']}: matmuls take {last['epd_matmul_s']:.2f} s in epd and "
              f"{last['hf_static_batch_matmul_s']:.2f} s in transformers; its static batch takes "
              f"{last['hf_static_batch_wall_s']:.2f} s in all -> epd can be at most "
              f"{last['ceiling_vs_hf_static_batch']:.2f}x faster without doing fewer matmul FLOPs")
    print(f"batch 1: TPOT {result['epd_tpot_ms_at_1']:.2f} ms vs bare decode step "
          f"{result['bare_decode_step_ms']:.2f} ms -> {result['tpot_over_bare_step']:.2f}x")


def _json_schema(value: str) -> dict:
    """--json-schema: inline JSON or a path to a JSON file."""
    text = value
    if not value.lstrip().startswith("{"):
        try:
            with open(value) as f:
                text = f.read()
        except OSError as exc:
            raise argparse.ArgumentTypeError(f"not inline JSON and not a readable file: {exc}") from None
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise argparse.ArgumentTypeError("a JSON schema must be an object")
    return schema


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint directory (e.g. made with `epd make-model --preset small`)")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.5,
                   help="lengths uniform in [L(1-r), L(1+r)]; 0 = every request alike")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    p.add_argument("--device", default="cpu", help="cpu (the issue's targets) or cuda[:N]")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16, for both engines")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--hf-sequential-max", type=int, default=4,
                   help="requests run one at a time through transformers (its rate does not depend on C)")
    p.add_argument("--matmul-floor", action="store_true",
                   help="at the largest C, also profile both engines' matmul time (the ceiling on any speed-up)")
    p.add_argument("--save-result", default=None)
    p.add_argument("--json-schema", type=_json_schema, default=None,
                   help="constrain EPD's outputs to this JSON schema (inline JSON or a file), to measure "
                        "structured outputs' cost per token; e.g. '{\"type\": \"array\", \"items\": "
                        "{\"type\": \"integer\"}}' never ends early (transformers runs unconstrained)")
