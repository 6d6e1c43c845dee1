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

And with "shared", `OMP_WAIT_POLICY=PASSIVE`: an OpenMP thread that waits
sleeps instead of spinning for the ~200k cycles libgomp spins by default, so
a busy worker's idle threads do not take the cores another worker (or
another job) is using. Two busy `epd worker`s on two shared cores took 48.1 s
for 30 requests of 200 tokens without it, 3.0 s with it (issue 33).

`epd serve`'s workers and `epd worker` take both from here: `worker_threads`
for the count and `share_cores` for the policy. An `epd worker` is counted as
the one worker of its host (`roles=[role]`): it cannot know its neighbours.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

from epd.transport.roles import Role

API_CORES = 1  # kept free for the API process
CPU_SHARING = ("split", "shared")
WAIT_POLICY_ENV = "OMP_WAIT_POLICY"


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, as taskset or a container sets it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def share_cores(cpu_sharing: str) -> None:
    """With "shared" cores, `OMP_WAIT_POLICY=PASSIVE` in this process's environment
    (unless the operator set a policy), for every worker process it then starts.
    libgomp reads it once, when torch loads it: call this before `import torch`
    in the worker's process or in the process that spawns the workers."""
    if cpu_sharing == "shared":
        os.environ.setdefault(WAIT_POLICY_ENV, "PASSIVE")


def worker_threads(role: Role | None, roles: Sequence[Role], num_cores: int, cpu_sharing: str) -> int:
    """Threads of a worker of `role` among `roles` (every worker the launcher
    starts) on `num_cores` cores; `role` None: those of an engine worker."""
    free = max(1, num_cores - API_CORES)
    if cpu_sharing == "split":
        return max(1, free // max(1, len(roles)))
    if role is not None and not role.holds_kv:
        return free
    return max(1, free // max(1, sum(r.holds_kv for r in roles)))
