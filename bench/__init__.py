"""`epd bench`: what a user runs to measure a server or the engine (installed as epd.bench).

serve.py         `epd bench serve`: open-loop load against a running server, goodput and latency
compare.py       `epd bench compare`: every mode on the same cores and one request trace
plan.py          `epd bench plan`: predict every E:P:D split's goodput, then run the best
offline.py       `epd bench offline`: the offline engine against transformers
datasets.py      the requests: random text, random text + images or videos, jsonl
multi_turn.py    the multi-turn workload: conversations whose turns resend the history
arrivals.py      when each request is sent: Poisson or gamma, seeded
load.py          the open-loop load generator
client.py        one streaming chat request, timed from the client
metrics.py       TTFT, TPOT, ITL, E2EL, goodput and their bootstrap intervals
report.py        the printed table and the result JSON (vLLM's field names)
spec_metrics.py  speculative decoding's acceptance, from the server's /metrics
prefix_cache_metrics.py  the prefix cache's hit rate over a run, from the server's /metrics
vllm_names.py    `vllm bench serve`'s flag names, taken by `epd bench serve`
plan_inputs.py   what the planner simulates: service times, the workload, the splits
plan_measure.py  the planner's service times, measured with the offline engine
plan_sim.py      the planner's simulation of one split

dev/             developer experiments, run from a checkout (not installed): vLLM comparisons,
                 micro-benchmarks, fault and reliability probes, network namespaces
"""
