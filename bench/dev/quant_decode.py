"""Offline decode tokens/s of quantized checkpoints against their float original, interleaved;
and with `--linears`, one decode layer's linears in each quantized form (bytes, us a call).

    python -m bench.dev.quant_decode /tmp/small /tmp/small-w8a8 --streams 32 --rounds 2
    python -m bench.dev.quant_decode --linears --rows 1,8,32,128 --threads 2
    python -m bench.dev.quant_decode --memory /tmp/small /tmp/small-w8a8 /tmp/small-awq

Each checkpoint (`epd make-model DIR --preset small`, then `--quantize w8a8` on a copy) runs
`--streams` prompts of `--input-len` tokens to `--output-len` tokens (ignore_eos) through the
offline `LLM`; the decode rate is the tokens after the first over the time past a
`max_tokens=1` run of the same prompts (prefill and the first token subtracted). Rounds
alternate the checkpoints so a loaded host's drift falls on both alike.

`--linears`: the small preset's four projections of a layer (qkv, o, gate_up, down; summed)
against float32 through oneDNN with a packed weight (`PackedLinear`, what a float checkpoint
runs) and W8A8 (`Int8Linear`): our kernel (`WeightOnlyLinear`, weight_only_cpu.c) for int4
with zero points (AWQ, GPTQ, W4A16), int8 (W8A16) and fp8 e4m3 (FP8 weight-only), group 128;
torch's own CPU ops where it has them: `_weight_int4pack_mm_for_cpu` (int4, group 128, float
zero points: w = (q - 8) * scale + zero) and `_weight_int8pack_mm` (int8, a scale per row).
Each call is the median of `--iters` after a warm-up.

`--memory`: each checkpoint's language model loaded alone (`load_language_model`, float32 CPU)
in a fresh process: the bytes its tensors hold, its RSS after the load and at its peak, in MB.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

SHAPES = {"qkv": (768, 1280), "o": (768, 768), "gate_up": (768, 4608), "down": (2304, 768)}  # (in, out)
GROUP = 128


def _median_us(fn, x, iters: int) -> float:
    for _ in range(3):
        fn(x)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _forms(k: int, n: int) -> dict[str, tuple[object, int]]:
    """name -> (callable x -> y, bytes of the weight it holds)."""
    from epd.transport.weights.cpu_linear import PackedLinear
    from epd.transport.weights.quant.int8_linear import Int8Linear, quantize_rows
    from epd.transport.weights.quant.weight_only_linear import WeightOnlyLinear

    def nbytes(*ts):
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    w = torch.randn(n, k) * 0.02
    forms = {}
    lin = nn.Linear(k, n, bias=False)
    lin.weight.data.copy_(w)
    forms["float32 PackedLinear"] = (PackedLinear(lin), nbytes(w))
    q8, s8 = quantize_rows(w)
    int8 = Int8Linear(q8, s8.view(-1), None)
    forms["W8A8 Int8Linear"] = (int8, nbytes(int8.weight_q, int8.weight_scale))
    groups = k // GROUP
    scale = torch.rand(n, groups) * 0.01
    for fmt, q, zero in (("int4", torch.randint(0, 16, (n, k), dtype=torch.uint8), torch.randint(0, 16, (n, groups))),
                         ("int8", q8, None), ("fp8", w.to(torch.float8_e4m3fn), None)):
        layer = WeightOnlyLinear(fmt, k, n, GROUP, None)
        layer.fill(0, q, scale, zero)
        forms[f"{fmt} WeightOnlyLinear (ours)"] = (layer, nbytes(layer.q, layer.scale, layer.zero))
    try:
        packed = torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
        sz = torch.randn(groups, n, 2) * 0.01
        forms["int4 torch _weight_int4pack_mm_for_cpu"] = (
            lambda x: torch._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz), nbytes(packed, sz))
    except RuntimeError as exc:
        print("torch int4:", exc)
    s_row = torch.rand(n) * 0.01
    forms["int8 torch _weight_int8pack_mm"] = (lambda x: torch._weight_int8pack_mm(x, q8, s_row), nbytes(q8, s_row))
    return forms


def _linears(rows: list[int], iters: int) -> None:
    per_shape = {name: _forms(k, n) for name, (k, n) in SHAPES.items()}
    names = list(next(iter(per_shape.values())))
    print(f"a small preset layer's four linears, {torch.get_num_threads()} threads; us a call (median of {iters})")
    print("| form | weight bytes | " + " | ".join(f"M={m}" for m in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    with torch.inference_mode():
        for name in names:
            total_bytes = sum(per_shape[s][name][1] for s in SHAPES)
            cells = []
            for m in rows:
                if "torch" in name and m > 32:
                    cells.append("-")  # hundreds of times float32's already at 32 rows
                    continue
                us = sum(_median_us(per_shape[s][name][0], torch.randn(m, SHAPES[s][0]), iters) for s in SHAPES)
                cells.append(f"{us:,.0f}")
            print(f"| {name} | {total_bytes / 1e6:.2f} MB | " + " | ".join(cells) + " |")


def _memory(model: str) -> None:
    """Prints the RSS of a fresh process after loading `model`'s language model, and its peak."""
    import subprocess
    import sys

    code = ("import os, resource, torch; from transformers import AutoConfig; "
            "from epd.engine.loader import load_language_model; "
            f"m = load_language_model({model!r}, AutoConfig.from_pretrained({model!r}), torch.float32); "
            "rss = int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 1e6; "
            "held = sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()]) / 1e6; "
            "print(f'{held:.0f} {rss:.0f} {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3:.0f}')")
    held, rss, peak = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True
                                     ).stdout.split()[-3:]
    print(f"{model}: language model loaded: tensors {held} MB, {rss} MB RSS, peak {peak} MB")


def _rate(llm, prompts, output_len: int) -> float:
    from epd import SamplingParams

    def run(n: int) -> float:
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - start

    run(2)  # warm-up
    first, full = run(1), run(output_len)
    return len(prompts) * (output_len - 1) / (full - first)


def main() -> None:
    from epd import LLM

    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="*")
    parser.add_argument("--linears", action="store_true", help="time one layer's linears in each form instead")
    parser.add_argument("--memory", action="store_true", help="each model's load RSS in a fresh process instead")
    parser.add_argument("--rows", default="1,8,32,128", help="--linears: rows of x (a step's tokens)")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--threads", type=int, default=0, help="torch's threads (0: as it starts)")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.linears:
        _linears([int(r) for r in args.rows.split(",")], args.iters)
        return
    if args.memory:
        for model in args.models:
            _memory(model)
        return
    prompts = [{"prompt_token_ids": [(7 * i + j) % 500 + 10 for j in range(args.input_len)]}
               for i in range(args.streams)]
    llms = {model: LLM(model) for model in args.models}
    rates = {model: [] for model in args.models}
    for _ in range(args.rounds):
        for model, llm in llms.items():
            rates[model].append(_rate(llm, prompts, args.output_len))
    for model, got in rates.items():
        print(f"{model}: decode {max(got):.1f} tok/s at {args.streams} streams (rounds: "
              f"{', '.join(f'{r:.1f}' for r in got)})")


if __name__ == "__main__":
    main()
