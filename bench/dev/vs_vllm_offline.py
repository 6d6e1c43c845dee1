"""The offline row of `python -m bench.dev.vs_vllm`: EPD's `LLM` against vLLM's `LLM`.

One workload (token-id prompts and output lengths, `offline._workload`, seeded)
is written to a JSON file; each engine then runs it in a fresh subprocess pinned
to the same CPUs with the same thread count: EPD's through `offline.bench_epd`
(`python -P bench/dev/vs_vllm_offline.py FILE`), vLLM's through
`vllm_offline_peer.py` in vLLM's environment. Each prints {"tok_s": ...}; the
timed part excludes start-up and one warm-up request in both.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PEER_SCRIPT = Path(__file__).with_name("vllm_offline_peer.py")


def write_workload(path: Path, model: str, dtype: str, threads: int, concurrency: int, input_len: int,
                   output_len: int, range_ratio: float, seed: int, kv_cache_gib: int = 4) -> None:
    from transformers import AutoTokenizer

    from epd.bench.offline import _workload

    prompts, output_lens = _workload(AutoTokenizer.from_pretrained(model), concurrency, input_len, output_len,
                                     range_ratio, seed)
    path.write_text(json.dumps({"model": model, "dtype": dtype, "threads": threads, "kv_cache_gib": kv_cache_gib,
                                "prompts": prompts, "output_lens": output_lens}))


def run_engine(python: str, script: list[str], workload: Path, cpus: set[int], log_path: Path,
               timeout_s: float) -> float | None:
    """Tokens/s from one engine's subprocess, or None when it failed (its output is in `log_path`)."""
    threads = json.loads(workload.read_text())["threads"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with open(log_path, "w") as log:
        try:
            done = subprocess.run([python, *script, str(workload)], stdout=subprocess.PIPE, stderr=log, text=True,
                                  env=env, timeout=timeout_s, preexec_fn=lambda: os.sched_setaffinity(0, cpus))
        except subprocess.TimeoutExpired:
            log.write(f"\nvs_vllm: timed out after {timeout_s:.0f} s\n")
            return None
        log.write(done.stdout)
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"tok_s"')]
    return json.loads(lines[-1])["tok_s"] if done.returncode == 0 and lines else None


def epd_command() -> list[str]:
    # by path, wherever this process started (-P: not bench/dev/ first on sys.path, as below)
    return ["-P", str(Path(__file__))]


def vllm_command() -> list[str]:
    # -P: not bench/dev/ first on sys.path (its kernels.py would shadow the `kernels` package vLLM imports)
    return ["-P", str(PEER_SCRIPT)]


def _epd_main(path: str) -> None:
    import torch

    from epd.bench.offline import bench_epd
    from epd.llm import LLM

    work = json.loads(Path(path).read_text())
    torch.set_num_threads(work["threads"])
    llm = LLM(work["model"], dtype=work["dtype"], max_num_seqs=len(work["prompts"]))
    print(json.dumps({"tok_s": bench_epd(llm, work["prompts"], work["output_lens"])}), flush=True)


if __name__ == "__main__":
    _epd_main(sys.argv[1])
