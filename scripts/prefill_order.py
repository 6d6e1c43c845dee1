"""How long text-only prompts wait at a prefill worker under image load, by
prefill order: the real `Scheduler` (prefill role), no model, time counted
in tokens of prefill work (a prefill-only step costs about its token count).

    .venv/bin/python scripts/prefill_order.py [--load 0.9] [--requests 4000]

Half the requests are text-only (`--text-len`, 400 tokens), half carry
images (`--image-len`, default 400 + two 336x336 images = 688 tokens, as in
docs/benchmarks_archive.md's mixed workload); Poisson
arrivals at `--load` of the worker's capacity. Reports P50/P99 time to the
first token (tokens of work from arrival to the end of the step that
sampled it) for each kind, under "fcfs" and "cost".
"""
from __future__ import annotations

import argparse
import random

import numpy as np

from epd.engine.request import Request
from epd.engine.scheduler import Scheduler
from epd.engine.scheduler_config import SchedulerConfig
from epd.transport.wire.sampling import SamplingParams

def simulate(priority: str, load: float, num_requests: int, budget: int, seed: int,
             text_len: int, image_len: int, aging: float) -> dict[str, list[float]]:
    rng = random.Random(seed)
    config = SchedulerConfig(max_num_batched_tokens=budget, prefill_priority=priority,
                             prefill_aging=aging, enable_prefix_caching=False)
    scheduler = Scheduler(config, num_blocks=100_000, role="prefill")
    mean_cost = (text_len + image_len) / 2
    arrivals, t = [], 0.0
    for i in range(num_requests):
        t += rng.expovariate(load / mean_cost)
        kind = "text" if rng.random() < 0.5 else "image"
        arrivals.append((t, kind, f"{kind}-{i}"))
    now, next_arrival, arrived_at, ttft = 0.0, 0, {}, {"text": [], "image": []}
    while next_arrival < len(arrivals) or scheduler.has_unfinished():
        while next_arrival < len(arrivals) and arrivals[next_arrival][0] <= now:
            at, kind, rid = arrivals[next_arrival]
            num_tokens = text_len if kind == "text" else image_len
            scheduler.add_request(Request(rid, [7] * num_tokens, SamplingParams(max_tokens=32)))
            arrived_at[rid] = (at, kind)
            next_arrival += 1
        if not scheduler.has_unfinished():
            now = arrivals[next_arrival][0]  # idle until the next arrival
            continue
        out = scheduler.schedule()
        now += out.num_batched_tokens
        for update in scheduler.update(out, {s.request_id: 1 for s in out.scheduled if s.is_last_chunk}):
            at, kind = arrived_at.pop(update.request_id)
            ttft[kind].append(now - at)
            if update.is_prefilled:
                scheduler.release(update.request_id)
    return ttft


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", type=float, default=0.9)
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--budget", type=int, default=2048, help="--max-num-batched-tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--aging", type=float, default=SchedulerConfig.prefill_aging, help="--prefill-aging")
    p.add_argument("--text-len", type=int, default=400, help="prompt tokens of a text-only request")
    p.add_argument("--image-len", type=int, default=400 + 2 * 144, help="prompt tokens of an image request")
    args = p.parse_args()
    rows = {}
    for priority in ("fcfs", "cost"):
        ttft = simulate(priority, args.load, args.requests, args.budget, args.seed, args.text_len, args.image_len, args.aging)
        rows[priority] = {kind: (np.percentile(v, 50), np.percentile(v, 99)) for kind, v in ttft.items()}
    print(f"load {args.load}, {args.requests} requests, text {args.text_len} / image {args.image_len} tokens, "
          f"budget {args.budget} tokens; TTFT in tokens of work")
    print("| order | text-only P50 | text-only P99 | image P50 | image P99 |")
    print("|---|---:|---:|---:|---:|")
    for priority, r in rows.items():
        print(f"| {priority} | {r['text'][0]:.0f} | {r['text'][1]:.0f} | {r['image'][0]:.0f} | {r['image'][1]:.0f} |")
    print(f"text-only P99, fcfs / cost: {rows['fcfs']['text'][1] / rows['cost']['text'][1]:.2f}x; "
          f"image P99, cost / fcfs: {rows['cost']['image'][1] / rows['fcfs']['image'][1]:.2f}x")


if __name__ == "__main__":
    main()
