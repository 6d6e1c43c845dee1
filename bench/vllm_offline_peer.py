"""vLLM's side of `python -m epd.bench.vs_vllm`'s offline row; run by vLLM's own Python.

    VLLM_PYTHON bench/vllm_offline_peer.py WORKLOAD.json

WORKLOAD.json (written by `epd.bench.vs_vllm_offline`): {"model", "dtype", "threads",
"kv_cache_gib", "prompts": [[token ids]], "output_lens": [n]}. The KV cache is sized by
VLLM_CPU_KVCACHE_SPACE (GiB): without it vLLM's CPU worker reserves a fraction of the whole
machine's memory and refuses to start when other processes hold it. Runs the same greedy, EOS-ignoring
requests through `vllm.LLM.generate` as EPD's `bench_epd` runs through `epd.llm.LLM`
(one warm-up on a prompt the run does not hold, then the timed batch) and prints one
JSON line {"tok_s": ...}. Imports nothing from EPD: vLLM's environment does not have it.
"""
import json
import os
import sys
import time


def main(path: str) -> None:
    work = json.load(open(path))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(work["kv_cache_gib"]))
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(work["threads"])
    llm = LLM(work["model"], dtype=work["dtype"], max_num_seqs=len(work["prompts"]), seed=0)
    prompts, output_lens = work["prompts"], work["output_lens"]
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0][::-1])],
                 SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = [len(o.outputs[0].token_ids) for o in outs]
    assert produced == output_lens, (produced, output_lens)
    print(json.dumps({"tok_s": sum(output_lens) / elapsed}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
