"""CPU seconds the offline engine spends on one fixed workload: EPD's `LLM`
or vLLM's, in-process, one torch thread (issue 32).

    python -m epd.bench.offline_cpu_time MODEL --engine epd
    /work/vllm-venv/bin/python -P bench/offline_cpu_time.py MODEL --engine vllm   (-P: bench/ not on sys.path)

The same token ids for both (seeded; new prompts each round, so no round
hits the prefix cache), greedy, EOS ignored; one warm-up request, then
`--rounds` timed batches. It prints the CPU time of the process
(`time.process_time`, every thread of it) and the wall time of each batch,
and the first output ids (the engines' tokens agree). CPU time is the figure
to compare on a shared machine: a neighbour's load stretches the wall time,
hardly the CPU time a single thread needs for the same work. vLLM runs with
`VLLM_ENABLE_V1_MULTIPROCESSING=0` so that its worker is this process, and
without its multimodal profile (`limit_mm_per_prompt` 0: text only), which
would otherwise run one largest video through the tower at start-up. This
file imports nothing of EPD's at module level: vLLM's environment has none.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time


def workload(num_prompts: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(input_len)] for _ in range(num_prompts)]


def epd_runner(model: str, num_prompts: int, output_len: int):
    from epd.llm import LLM
    from epd.transport.sampling import SamplingParams

    llm = LLM(model, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    return lambda prompts: [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def vllm_runner(model: str, num_prompts: int, output_len: int):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model, dtype="float32", max_num_seqs=num_prompts, seed=0,
              limit_mm_per_prompt={"image": 0, "video": 0})
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    return lambda prompts: [list(o.outputs[0].token_ids) for o in llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--engine", choices=["epd", "vllm"], required=True)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--vocab", type=int, default=8000, help="token ids are drawn below this")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    make = epd_runner if args.engine == "epd" else vllm_runner
    run = make(args.model, args.num_prompts, args.output_len)
    run([workload(1, args.input_len, args.vocab, args.seed - 1)[0]])  # warm-up on a prompt no batch holds
    for r in range(args.rounds):
        prompts = workload(args.num_prompts, args.input_len, args.vocab, args.seed + r)  # new: no prefix-cache hit
        cpu, wall = time.process_time(), time.perf_counter()
        outputs = run(prompts)
        print(json.dumps({"engine": args.engine, "cpu_s": round(time.process_time() - cpu, 2),
                          "wall_s": round(time.perf_counter() - wall, 2), "first_ids": outputs[0][:8]}), flush=True)


if __name__ == "__main__":
    main()
