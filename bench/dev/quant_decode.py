"""Offline decode tokens/s of quantized checkpoints against their float original, interleaved.

    python -m bench.dev.quant_decode /tmp/small /tmp/small-w8a8 --streams 32 --rounds 2

Each checkpoint (`epd make-model DIR --preset small`, then `--quantize w8a8` on a copy) runs
`--streams` prompts of `--input-len` tokens to `--output-len` tokens (ignore_eos) through the
offline `LLM`; the decode rate is the tokens after the first over the time past a
`max_tokens=1` run of the same prompts (prefill and the first token subtracted). Rounds
alternate the checkpoints so a loaded host's drift falls on both alike.
"""
from __future__ import annotations

import argparse
import time


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
    parser.add_argument("models", nargs="+")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
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
