"""`python -m bench.dev.multi_turn_prefix MODEL_DIR`: prefix caching on a multi-turn workload,
offline, with it on and off side by side (made for a model with per-request state, e.g.
`epd make-model DIR --preset qwen3.5-small`, whose hits resume from state snapshots:
docs/decisions/state-snapshots.md; any checkpoint runs).

The workload: --conversations conversations of --turns turns, all opening with one system
prompt of --system-len tokens; each turn adds a user message of --user-len tokens, and its
prompt is the previous turn's prompt, its answer (--answer-len greedy tokens, EOS ignored) and
the new message. Turn t of every conversation is one `generate` call, so the conversations run
side by side. Per setting: the prefix-cache hit rate (hits / looked-up prompt tokens, the
engine's `epd:prefix_cache_*` counters), prompt tokens computed, hits that resumed from a state
snapshot, wall seconds, and whether its greedy answers equal the other setting's.
"""
from __future__ import annotations

import argparse
import time

from epd.bench.report import write_result


def _workload(args, llm) -> tuple[dict, list[list[int]]]:
    """Runs every turn on `llm`; (its counters and time, every answer in order)."""
    import torch

    from epd.transport.wire.sampling import SamplingParams

    gen = torch.Generator().manual_seed(args.seed)
    draw = lambda n: torch.randint(16, 1000, (n,), generator=gen).tolist()  # noqa: E731
    system = draw(args.system_len)
    prompts = [system + draw(args.user_len) for _ in range(args.conversations)]
    params = SamplingParams(temperature=0, max_tokens=args.answer_len, ignore_eos=True)
    before, answers, num_prompt_tokens, start = llm.stats(), [], 0, time.perf_counter()
    for _ in range(args.turns):
        num_prompt_tokens += sum(len(p) for p in prompts)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        turn = [out.outputs[0].token_ids for out in outs]
        answers += turn
        prompts = [p + a + draw(args.user_len) for p, a in zip(prompts, turn)]
    seconds, after = time.perf_counter() - start, llm.stats()
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]  # 0 with prefix caching off
    return {"seconds": seconds, "prompt_tokens": num_prompt_tokens, "hit_tokens": hits,
            "hit_rate": hits / num_prompt_tokens, "computed_prompt_tokens": num_prompt_tokens - hits,
            "snapshot_hits": after.get("state_snapshot_hits", 0) - before.get("state_snapshot_hits", 0)}, answers


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--user-len", type=int, default=48)
    p.add_argument("--answer-len", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--kv-cache-gb", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", default=None, help="a JSON file for the rows")
    args = p.parse_args(argv)
    from epd import LLM

    rows, answers = [], {}
    for enable in (True, False):  # one engine at a time, the same workload (same seed)
        llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, kv_cache_gb=args.kv_cache_gb,
                  enable_prefix_caching=enable)
        llm.generate([{"prompt_token_ids": [20, 21, 22, 23]}])  # warm-up, outside the counters
        row, answers[enable] = _workload(args, llm)
        rows.append({"prefix_caching": enable, **row})
        del llm
    result = {"model": args.model, "conversations": args.conversations, "turns": args.turns,
              "system_len": args.system_len, "user_len": args.user_len, "answer_len": args.answer_len,
              "rows": rows, "identical_answers": sum(a == b for a, b in zip(answers[True], answers[False])),
              "num_answers": len(answers[True])}
    print(f"{'prefix caching':<15} {'hit rate':>8} {'prompt tok':>10} {'computed':>9} {'snapshot hits':>13} {'s':>7}")
    for r in rows:
        print(f"{'on' if r['prefix_caching'] else 'off':<15} {r['hit_rate']:>8.1%} {r['prompt_tokens']:>10} "
              f"{r['computed_prompt_tokens']:>9} {r['snapshot_hits']:>13} {r['seconds']:>7.2f}")
    print(f"greedy answers identical on and off: {result['identical_answers']} / {result['num_answers']}")
    if args.save_result:
        write_result(args.save_result, result)
    return result


if __name__ == "__main__":
    main()
