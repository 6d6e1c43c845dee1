"""The planner's service times, measured in-process with the offline engine (`epd.LLM`).

Why in-process and not from a server's /metrics: the simulation needs each
stage's time when it runs alone — encode per image, prefill per token, and a
decode step as a function of the batch — and /metrics exports encode and KV
transfer times but no prefill or decode step times; a decode step at a
chosen batch size needs the batch held fixed, which only the engine itself
allows. The process is pinned to the same cores; on shared cores it runs one
thread (the simulation counts a worker's work in one thread's time and
gives it as many cores as its threads get, bench/plan_sim.py), with a
device a worker (`--device-per-worker`) as many threads as cores.

  * encode  — the workload's images through the vision encoder, a request's
              images together (the encoder worker batches them too); the
              fastest of the requests, per image.
  * prefill — a fresh prompt of as many tokens as the workload's (text plus
              image placeholders, counted by a warm-up chat) with max_tokens 1,
              per prompt token (the fastest): a placeholder costs a prefill what
              a text token does.
  * decode  — B prompts of the workload's length run once (filling the prefix
              cache), then again for 1 and for 1 + S tokens: the difference
              over S is one step at batch B; a line through B = 1 and B = 4.
KV transfer between workers is not measured here (`--kv-transfer-ms`).
A text-only request's prompt tokens (for `--text-only-ratio`) are counted by
the chat template alone, without running it: the same text, no images.
"""
from __future__ import annotations

import base64
import dataclasses
import os
import time

from epd.bench.client import build_payload
from epd.bench.datasets import load_tokenizer, sample_random_mm
from epd.bench.plan_inputs import ServiceTimes, Workload

DECODE_BATCHES = (1, 4)
DECODE_STEPS = 12
PROBE_REQUESTS = 2
REPEATS = 2  # the fastest of REPEATS runs: other jobs on the machine only ever slow a run down


def _image_bytes(url: str) -> bytes:
    return base64.b64decode(url.split(",", 1)[1])


def measure(args, cpus: set[int]) -> tuple[ServiceTimes, Workload]:
    """Service times and the workload's shape (prompt tokens as the engine counts them)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the served workers run (before torch starts OpenMP)
    import torch

    from epd.llm import LLM
    from epd.transport.wire.sampling import SamplingParams

    saved_affinity, saved_threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus) if args.device_per_worker else 1)
    try:
        llm = LLM(args.model_dir, max_num_seqs=max(DECODE_BATCHES))
        requests = sample_random_mm(
            PROBE_REQUESTS + 1, args.input_len, args.output_len, images_per_request=args.images_per_request,
            image_sizes=args.image_size, image_format=args.image_format, seed=args.seed + 3000,
            tokenizer=load_tokenizer(args.tokenizer))
        one_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        # warm-up, not counted; the engine's count of the workload's prompt (text + image placeholders)
        (out,) = llm.chat(build_payload("m", requests[-1])["messages"], one_token)
        prompt_tokens = len(out.prompt_token_ids)
        text_only = dataclasses.replace(requests[-1], image_urls=())
        text_prompt_tokens = len(llm.inputs.prompts.build(build_payload("m", text_only)["messages"], []).token_ids)
        encode_ms, prefill_ms = [], []
        for i, request in enumerate(requests[:PROBE_REQUESTS]):
            images = [_image_bytes(url) for url in request.image_urls]
            start = time.perf_counter()
            if images:
                llm.encoder.encode(images)
            encode_ms.append((time.perf_counter() - start) * 1e3 / max(1, len(images)))
            start = time.perf_counter()  # a prompt of as many tokens, never seen: no prefix-cache hit
            llm.generate([_token_prompt(llm, prompt_tokens, salt=1000 + i)], one_token)
            prefill_ms.append((time.perf_counter() - start) * 1e3)
        step_ms = {b: _decode_step_ms(llm, b, prompt_tokens) for b in DECODE_BATCHES}
        low, high = DECODE_BATCHES[0], DECODE_BATCHES[-1]
        per_seq = max(0.0, (step_ms[high] - step_ms[low]) / (high - low))
        base = max(0.0, step_ms[low] - per_seq * low)
        del llm
    finally:
        os.sched_setaffinity(0, saved_affinity)
        torch.set_num_threads(saved_threads)
    times = ServiceTimes(encode_ms_per_image=min(encode_ms) if args.images_per_request else 0.0,
                         prefill_ms_per_token=max(0.0, min(prefill_ms)) / prompt_tokens,
                         decode_step_ms=base, decode_ms_per_seq=per_seq,
                         kv_transfer_ms=args.kv_transfer_ms)
    return times, Workload(args.images_per_request, prompt_tokens, args.output_len,
                           text_only_ratio=args.text_only_ratio, text_prompt_tokens=text_prompt_tokens,
                           input_len=args.input_len, image_sizes=tuple(args.image_size))


def _token_prompt(llm, num_tokens: int, salt: int) -> list[int]:
    """`num_tokens` token ids clear of the special tokens at the start of the vocabulary; distinct per salt."""
    vocab = len(llm.tokenizer)
    return [300 + (7919 * (salt + 1) + 104729 * j) % (vocab - 300) for j in range(num_tokens)]


def _decode_step_ms(llm, batch: int, prompt_tokens: int) -> float:
    from epd.transport.wire.sampling import SamplingParams

    prompts = [_token_prompt(llm, prompt_tokens, salt=batch * 100 + i) for i in range(batch)]

    def run(max_tokens: int) -> float:
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        return time.perf_counter() - start

    run(1)  # prefills: the prompts are in the prefix cache from now on
    base_s = min(run(1) for _ in range(REPEATS))
    return max(0.0, min(run(1 + DECODE_STEPS) for _ in range(REPEATS)) - base_s) * 1e3 / DECODE_STEPS
