"""vLLM's side of EPD's offline comparisons, run by vLLM's own Python; the one place
that builds and drives vLLM's `LLM` for them.

    VLLM_PYTHON -P bench/dev/vllm_offline_peer.py WORKLOAD.json

WORKLOAD.json (written by `bench.dev.vs_vllm_offline`): {"model", "dtype", "threads",
"kv_cache_gib", "prompts": [[token ids]], "output_lens": [n]}. Runs the same greedy,
EOS-ignoring requests through `vllm.LLM.generate` as EPD's `bench_epd` runs through
`epd.llm.LLM` (one warm-up on a prompt the run does not hold, then the timed batch) and
prints one JSON line {"tok_s", "cpu_s", "wall_s", "first_ids"}: tokens per wall second,
the CPU seconds of the process over the batch (every thread of it, the engine's
included: see `make_llm`) and the first output ids. `bench/dev/offline_cpu_time.py
--engine vllm` drives vLLM through this file's `make_llm` and `generate` too (it loads
the file by path). Imports nothing from EPD: vLLM's environment does not have it.
(-P: bench/dev/ not first on sys.path; its kernels.py would shadow the `kernels` package
vLLM imports.)
"""
import json
import os
import sys
import time


def make_llm(model: str, dtype: str, max_num_seqs: int, kv_cache_gib: int):
    """vLLM's offline engine as both benchmarks run it: its engine core in this process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0, as EPD's `LLM` is one process, so the process's CPU
    time is the engine's), text only (`limit_mm_per_prompt` 0: no start-up profile that
    runs the largest video through the tower, minutes here), seed 0, and the KV cache
    sized by VLLM_CPU_KVCACHE_SPACE (GiB; without it vLLM's CPU worker reserves a fraction
    of the machine's memory and refuses to start when other processes hold it). A
    variable already set in the environment wins."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    from vllm import LLM

    return LLM(model, dtype=dtype, max_num_seqs=max_num_seqs, seed=0, limit_mm_per_prompt={"image": 0, "video": 0})


def generate(llm, prompts: list[list[int]], output_lens: list[int]) -> list[list[int]]:
    """Greedy, EOS ignored: exactly `output_lens[i]` token ids after `prompts[i]` (token ids)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    ids = [list(o.outputs[0].token_ids) for o in outs]
    assert [len(t) for t in ids] == list(output_lens), ([len(t) for t in ids], output_lens)
    return ids


def main(path: str) -> None:
    work = json.load(open(path))
    import torch

    torch.set_num_threads(work["threads"])
    prompts, output_lens = work["prompts"], work["output_lens"]
    llm = make_llm(work["model"], work["dtype"], len(prompts), work["kv_cache_gib"])
    generate(llm, [prompts[0][::-1]], [2])
    cpu, start = time.process_time(), time.perf_counter()
    ids = generate(llm, prompts, output_lens)
    wall_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    print(json.dumps({"tok_s": sum(output_lens) / wall_s, "cpu_s": round(cpu_s, 2), "wall_s": round(wall_s, 2),
                      "first_ids": ids[0][:8]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
