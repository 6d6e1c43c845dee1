"""`python -m bench.dev.spec_decode`: speculative decoding's decode tokens/s and TPOT per method, in one engine.

For each method and each number of streams C (default 1, 8, 32), C greedy
requests of one workload start together in an offline engine (`LLM`'s
EngineCore, so no HTTP or detokenizing in the clock), each for exactly
`--output-len` tokens (EOS ignored):

  none         no speculation
  ngram        {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
  draft_model  {"method": "draft_model", "model": --draft, "num_speculative_tokens": k}
  rejected     the same with --wrong-draft, a draft the target (nearly) never accepts
               (`epd make-model DIR --draft-of MODEL --disagree`): what a fully rejected draft costs
  NAME         any other `--spec NAME=JSON` (e.g. mtp='{"method": "mtp", "num_speculative_tokens": 3}' on a
               Qwen3.5 checkpoint; `epd make-model DIR --preset qwen3.5-small --mtp-agree` makes MTP
               layers that agree with their target)

Once every request has its first token, the engine's steps are timed:
decode tokens/s = tokens those steps emitted / their wall time; TPOT = per
request (last token's time - first token's) / (tokens - 1), the median over
requests; `draft_ms` = time in the proposer per step (n-gram search, or the
draft model's forwards). Acceptance comes from the engine's counters over
the run: rate = accepted / draft tokens, length = 1 + accepted / drafts.

The workload: a phrase of 4-8 words repeated 12 times (bench/dev/spec_ngram.sh's),
so the n-gram proposer has something to draft; a random-weight model's greedy
output tends to loop too. Every method sees the same prompts.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

WORDS = "red green blue cat dog sun moon tree river stone cloud bird fish wind".split()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="the target checkpoint")
    p.add_argument("--draft", default=None, help="draft_model's checkpoint (`epd make-model DIR --draft-of MODEL "
                                                 "--num-layers N`); without it the draft_model row is left out")
    p.add_argument("--wrong-draft", default=None, help="a draft that disagrees (`--draft-of MODEL --disagree`): "
                                                       "the 'rejected' row")
    p.add_argument("--spec", action="append", default=[], metavar="NAME=JSON",
                   help="another row: a --speculative-config JSON under NAME (repeatable)")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32], help="concurrent requests per run")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1, help="runs per (method, streams); the median is reported")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-gb", type=float, default=2.0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (1: a shared machine's other load does not stall a step's thread sync)")
    p.add_argument("--seed", type=int, default=0, help="seeds the workload")
    p.add_argument("--save-result", default=None, metavar="FILE", help="the rows as JSON")


def methods(args) -> dict[str, dict | None]:
    """Row name -> --speculative-config (None: without)."""
    k = args.num_speculative_tokens
    rows: dict[str, dict | None] = {"none": None, "ngram": {"method": "ngram", "num_speculative_tokens": k,
                                                            "prompt_lookup_min": 1, "prompt_lookup_max": 3}}
    if args.draft:
        rows["draft_model"] = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": k}
    if args.wrong_draft:
        rows["rejected"] = {"method": "draft_model", "model": args.wrong_draft, "num_speculative_tokens": k}
    for item in args.spec:
        name, _, text = item.partition("=")
        if not name or not text:
            raise SystemExit(f"python -m bench.dev.spec_decode: --spec takes NAME=JSON, got {item!r}")
        rows[name] = json.loads(text)
    return rows


def workload(tokenizer, num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        phrase = " ".join(rng.sample(WORDS, rng.randint(4, 8)))
        prompts.append(tokenizer.encode((phrase + ". ") * 12))
    return prompts


def _counters(engine) -> tuple[int, int, int]:
    s = engine.stats()
    return s["spec_decode_num_drafts"], s["spec_decode_num_draft_tokens"], s["spec_decode_num_accepted_tokens"]


class _Timed:
    """Wraps the engine's proposer: seconds spent drafting."""

    def __init__(self, proposer):
        self.proposer, self.seconds = proposer, 0.0

    def propose_requests(self, requests):
        start = time.perf_counter()
        try:
            return self.proposer.propose_requests(requests)
        finally:
            self.seconds += time.perf_counter() - start


def run_streams(engine, prompts: list[list[int]], output_len: int, tag: str) -> dict:
    """One run: the prompts start together; their decode steps timed."""
    from epd.engine.request import Request
    from epd.transport.wire.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(Request(rid, list(prompt), params))
    times: dict[str, list[float]] = {rid: [] for rid in ids}
    before, drafted = _counters(engine), engine.proposer.seconds if engine.proposer else 0.0
    decode_tokens, decode_s, decode_steps, draft_s = 0, 0.0, 0, 0.0
    while engine.has_unfinished():
        all_started = all(times.values())
        start = time.perf_counter()
        result = engine.step()
        now = time.perf_counter()
        for u in result.updates:
            times[u.request_id] += [now] * len(u.new_token_ids)
        if all_started:
            decode_tokens += sum(len(u.new_token_ids) for u in result.updates)
            decode_s += now - start
            decode_steps += 1
    if engine.proposer is not None:
        draft_s = engine.proposer.seconds - drafted
    assert all(len(t) == output_len for t in times.values()), "every request runs to --output-len"
    drafts, draft_tokens, accepted = (a - b for a, b in zip(_counters(engine), before))
    return {"decode_tok_s": decode_tokens / decode_s,
            "tpot_ms": 1000 * statistics.median((t[-1] - t[0]) / (len(t) - 1) for t in times.values()),
            "draft_ms_per_step": 1000 * draft_s / max(decode_steps, 1),
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "acceptance_length": 1 + accepted / drafts if drafts else None}


def bench_method(args, name: str, spec: dict | None, prompts: list[list[int]]) -> list[dict]:
    from epd import LLM
    from epd.transport.wire.sampling import SamplingParams

    llm = LLM(args.model, dtype=args.dtype, device=args.device, kv_cache_gb=args.kv_cache_gb,
              speculative_config=spec)
    engine = llm.engine
    if engine.proposer is not None:
        engine.proposer = _Timed(engine.proposer)
    llm.generate([prompts[0][::-1]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
    rows = []
    for streams in args.streams:
        runs = [run_streams(engine, prompts[:streams], args.output_len, f"{name}-{streams}-{r}")
                for r in range(args.repeats)]
        row = {"method": name, "streams": streams}
        for key in runs[0]:
            values = [r[key] for r in runs if r[key] is not None]
            row[key] = statistics.median(values) if values else None
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _line(row: dict) -> str:
    def fmt(value, spec: str, scale: float = 1.0) -> str:
        return "-" if value is None else format(value * scale, spec)

    return (f"| {row['method']} | {row['streams']} | {row['decode_tok_s']:.1f} | {row['tpot_ms']:.2f} | "
            f"{fmt(row['draft_ms_per_step'] if row['method'] != 'none' else None, '.2f')} | "
            f"{fmt(row['acceptance_rate'], '.1f', 100)}{'' if row['acceptance_rate'] is None else '%'} | "
            f"{fmt(row['acceptance_length'], '.2f')} |")


def main(args) -> dict:
    import torch
    from transformers import AutoTokenizer

    from epd.bench.report import write_result

    if args.device == "cpu":
        torch.set_num_threads(args.threads)

    prompts = workload(AutoTokenizer.from_pretrained(args.model), max(args.streams), args.seed)
    print("| method | streams | decode tok/s | median TPOT (ms) | draft ms/step | acceptance rate | "
          "acceptance length |\n|---|---|---|---|---|---|---|", flush=True)
    rows = [row for name, spec in methods(args).items() for row in bench_method(args, name, spec, prompts)]
    result = {"model": args.model, "output_len": args.output_len, "k": args.num_speculative_tokens,
              "repeats": args.repeats, "threads": args.threads, "rows": rows}
    if args.save_result:
        write_result(args.save_result, result)
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.dev.spec_decode", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return parser


if __name__ == "__main__":
    main(build_parser().parse_args())
