"""How many torch threads each worker of `epd serve` runs.

The API process is one event loop: under load it needs up to one core of
its own (it was measured at about half a core at 13,000 output tokens/s),
and it is on the path of every token. Workers whose threads outnumber the
cores left make every step wait for a descheduled thread (a torch parallel
region ends when its slowest thread does): on 2 CPUs a step of the tiny
checkpoint that takes 1.94 ms offline took ~5 ms served with one thread per
core in each worker. So:

    cores left for workers = cores - API_CORES (at least 1)
    split:   every worker gets an equal share of them
    shared:  each engine worker (prefill, decode, pd, aggregated: the ones
             busy at the same time under load) gets an equal share; an
             encoder (niced, busy in bursts) may use all of them

`--threads-per-worker` overrides the rule.
"""
from __future__ import annotations

from collections.abc import Sequence

from epd.transport.roles import Role

API_CORES = 1  # kept free for the API process


def worker_threads(role: Role | None, roles: Sequence[Role], num_cores: int, cpu_sharing: str) -> int:
    """Threads of a worker of `role` among `roles` (every worker the launcher
    starts) on `num_cores` cores; `role` None: those of an engine worker."""
    free = max(1, num_cores - API_CORES)
    if cpu_sharing == "split":
        return max(1, free // max(1, len(roles)))
    if role is not None and not role.holds_kv:
        return free
    return max(1, free // max(1, sum(r.holds_kv for r in roles)))
