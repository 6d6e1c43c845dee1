"""`python -m bench.dev.lora`: what multi-LoRA costs, offline, side by side in one run.

Rows (C requests of --input-len prompt and --output-len output tokens, EOS ignored):
  * base         — the base model on an engine without --enable-lora (the reference row);
  * base+lora    — the same requests, no adapter, on the LoRA engine (the wrappers' idle cost);
  * N adapters   — the requests spread round-robin over N adapters (N in --num-adapters,
                   default 1, 4, 16), rank --rank on every projection, on the LoRA engine
                   (--max-loras = the largest N: every adapter resident, so this measures the
                   gathered low-rank matmuls, not slot writes).
Per row: output tokens/s, and TPOT = (time of the batch with L output tokens - time of
the same batch with 1) / (L - 1), the decode step time each request sees. The machine
may be shared and noisy: rows run interleaved for --rounds rounds, the median of each
is kept, and each is given as a ratio to the base row of the same run.

Load cost on the request path: one request (--input-len prompt, 1 output token) whose
adapter is in host memory, against one whose adapter was never read (a new directory
each time: the read and the slot write happen on its path, in the loader thread while
the request waits outside the scheduler), medians over --load-rounds; and the read and
check alone (`EngineCore.load_lora`, waited for).

The adapters are random PEFT-format directories written here (adapter_config.json +
adapter_model.safetensors; no peft needed), checked by the engine as any other.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from epd.bench.report import write_result


def write_adapter(out_dir: str | Path, shapes, rank: int, seed: int) -> str:
    """A random LoRA adapter on every projection of the language model (MoE layers: attention only)."""
    import torch
    from safetensors.torch import save_file

    from epd.engine.lora.adapter import ATTENTION_MODULES, MLP_MODULES

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shapes.num_layers):
        for module in ATTENTION_MODULES + (() if layer in shapes.moe_layer_ids else MLP_MODULES):
            in_features, out_features = shapes.sizes[module]
            part = "self_attn" if module in ATTENTION_MODULES else "mlp"
            key = f"base_model.model.model.language_model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * 0.02
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": list(ATTENTION_MODULES + MLP_MODULES)}))
    return str(out)


def _shifted(prompt: list[int], k: int, low: int, vocab: int) -> list[int]:
    """The prompt with every token moved by k within [low, vocab): a new prompt, no prefix-cache hit."""
    return [low + (t - low + k) % (vocab - low) for t in prompt]


def _timed(llm, prompts, params, loras) -> float:
    start = time.perf_counter()
    llm.generate(prompts, params, lora_request=loras)
    return time.perf_counter() - start


def _row(llm, prompts, output_len: int, loras) -> tuple[float, float]:
    """(output tokens/s, TPOT s) of one run of `prompts` (each with its adapter in `loras`)."""
    from epd.transport.wire.sampling import SamplingParams

    full = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    elapsed = _timed(llm, prompts, full, loras)
    prefill = _timed(llm, prompts, first, loras)
    return len(prompts) * output_len / elapsed, (elapsed - prefill) / max(1, output_len - 1)


def _load_cost(llm, shapes, tmp: Path, prompt: list[int], warm, rounds: int, rank: int,
               vocab: tuple[int, int]) -> dict:
    """Medians of one request's time with its adapter in host memory and never read."""
    from epd.transport.wire.lora_request import LoRARequest
    from epd.transport.wire.sampling import SamplingParams

    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    warm_s, cold_s = [], []
    for i in range(rounds):
        # new prompts: no prefix-cache hit for either
        warm_s.append(_timed(llm, [_shifted(prompt, 100 + 2 * i, *vocab)], one, [warm]))
        cold = LoRARequest(f"cold{i}", 1000 + i, write_adapter(tmp / f"cold{i}", shapes, rank, seed=1000 + i))
        cold_s.append(_timed(llm, [_shifted(prompt, 101 + 2 * i, *vocab)], one, [cold]))
    read_s = []
    for i in range(rounds):  # the read and check alone (what the loader thread does), waited for
        path = write_adapter(tmp / f"read{i}", shapes, rank, seed=2000 + i)
        start = time.perf_counter()
        llm.engine.load_lora(LoRARequest(f"read{i}", 2000 + i, path))
        read_s.append(time.perf_counter() - start)
    warm_ms, cold_ms = statistics.median(warm_s) * 1e3, statistics.median(cold_s) * 1e3
    return {"warm_request_ms": warm_ms, "cold_request_ms": cold_ms, "load_cost_ms": cold_ms - warm_ms,
            "read_ms": statistics.median(read_s) * 1e3}


def main(args) -> dict:
    import random

    import torch
    from transformers import AutoConfig

    from epd.engine.lora.adapter import ProjectionShapes
    from epd.llm import LLM
    from epd.transport.wire.lora_request import LoRARequest

    if args.threads:
        torch.set_num_threads(args.threads)
    hf_config = AutoConfig.from_pretrained(args.model)
    shapes = ProjectionShapes.from_hf(hf_config)
    vocab = (min(300, hf_config.text_config.vocab_size // 4), hf_config.text_config.vocab_size)
    tmp = Path(tempfile.mkdtemp(prefix="epd-bench-lora-"))
    most = max(args.num_adapters)
    adapters = [LoRARequest(f"a{i}", i + 1, write_adapter(tmp / f"a{i}", shapes, args.rank, seed=i))
                for i in range(most)]
    common = {"dtype": args.dtype, "device": args.device, "max_num_seqs": args.concurrency}
    base = LLM(args.model, **common)
    tuned = LLM(args.model, enable_lora=True, max_loras=most, max_lora_rank=args.max_lora_rank, **common)
    rng = random.Random(0)
    prompts = [[rng.randrange(*vocab) for _ in range(args.input_len)] for _ in range(args.concurrency)]
    cases = {"base": (base, None), "base+lora": (tuned, None)}
    cases.update({f"{n} adapters": (tuned, [adapters[i % n] for i in range(args.concurrency)])
                  for n in args.num_adapters})
    for llm, loras in cases.values():  # warm-up: every adapter read and resident before the clock
        _row(llm, prompts, 2, loras)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for r in range(args.rounds):
        batch = [_shifted(p, r + 1, *vocab) for p in prompts]  # new prompts each round: no prefix-cache hit
        for name, (llm, loras) in cases.items():
            samples[name].append(_row(llm, batch, args.output_len, loras))
    rows = []
    for name, runs in samples.items():
        tok_s, tpot = statistics.median(s[0] for s in runs), statistics.median(s[1] for s in runs)
        rows.append({"case": name, "tok_s": tok_s, "tpot_ms": tpot * 1e3})
    for row in rows:
        row["tok_s_vs_base"], row["tpot_vs_base"] = row["tok_s"] / rows[0]["tok_s"], row["tpot_ms"] / rows[0]["tpot_ms"]
    load = _load_cost(tuned, shapes, tmp, prompts[0], adapters[0], args.load_rounds, args.rank, vocab)
    result = {"model": args.model, "device": args.device, "dtype": args.dtype, "threads": torch.get_num_threads(),
              "adapter_mb": (Path(adapters[0].lora_path) / "adapter_model.safetensors").stat().st_size / 2**20,
              "concurrency": args.concurrency, "input_len": args.input_len, "output_len": args.output_len,
              "rank": args.rank, "rounds": args.rounds, "rows": rows, "load": load}
    _print_table(result)
    if args.save_result:
        write_result(args.save_result, result)
    return result


def _print_table(result: dict) -> None:
    print(f"\n{'case':<12} {'tok/s':>9} {'x base':>7} {'TPOT ms':>8} {'x base':>7}")
    for r in result["rows"]:
        print(f"{r['case']:<12} {r['tok_s']:>9.1f} {r['tok_s_vs_base']:>7.2f} {r['tpot_ms']:>8.2f} "
              f"{r['tpot_vs_base']:>7.2f}")
    load = result["load"]
    print(f"adapter file {result['adapter_mb']:.2f} MB")
    print(f"one request, adapter in host memory: {load['warm_request_ms']:.1f} ms; never read: "
          f"{load['cold_request_ms']:.1f} ms -> load cost {load['load_cost_ms']:.1f} ms "
          f"(the read and check alone: {load['read_ms']:.2f} ms)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint directory (e.g. made with `epd make-model --preset tiny`)")
    p.add_argument("--concurrency", type=int, default=16, help="requests per batch")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-adapters", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16],
                   help="adapter counts to mix, comma-separated")
    p.add_argument("--rank", type=int, default=16, help="every adapter's rank")
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
    p.add_argument("--load-rounds", type=int, default=20, help="requests per side of the load cost (medians)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--save-result", default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.dev.lora", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return parser


if __name__ == "__main__":
    main(build_parser().parse_args())
