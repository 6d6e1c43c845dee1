"""CPU seconds the offline engine spends on one fixed workload: EPD's `LLM`
or vLLM's, in-process, one torch thread (issue 32).

    python -m bench.dev.offline_cpu_time MODEL --engine epd
    /work/vllm-venv/bin/python -P bench/dev/offline_cpu_time.py MODEL --engine vllm   (-P: bench/dev/ not on sys.path)

The same token ids for both (seeded; new prompts each round, so no round
hits the prefix cache), greedy, EOS ignored; one warm-up request, then
`--rounds` timed batches. It prints the CPU time of the process
(`time.process_time`, every thread of it) and the wall time of each batch,
and the first output ids (the engines' tokens agree). CPU time is the figure
to compare on a shared machine: a neighbour's load stretches the wall time,
hardly the CPU time a single thread needs for the same work. vLLM is built
and driven by bench/dev/vllm_offline_peer.py's `make_llm` and `generate` (its
worker in this process, text only; see there), as for `python -m bench.dev.vs_vllm`'s
offline row. This file imports nothing of EPD's at module level: vLLM's
environment has none.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
import time
from pathlib import Path


def workload(num_prompts: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(input_len)] for _ in range(num_prompts)]


def epd_runner(model: str, num_prompts: int, output_len: int):
    from epd.llm import LLM
    from epd.transport.wire.sampling import SamplingParams

    llm = LLM(model, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    return lambda prompts: [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def vllm_runner(model: str, num_prompts: int, output_len: int):
    peer = _vllm_peer()
    llm = peer.make_llm(model, "float32", num_prompts, kv_cache_gib=4)
    return lambda prompts: peer.generate(llm, prompts, [output_len] * len(prompts))


def _vllm_peer():
    """bench/dev/vllm_offline_peer.py, loaded by path: under vLLM's Python (-P) this folder is not on sys.path."""
    path = Path(__file__).with_name("vllm_offline_peer.py")
    spec = importlib.util.spec_from_file_location("vllm_offline_peer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
