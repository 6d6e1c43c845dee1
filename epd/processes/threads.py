"""How many torch threads each worker of `epd serve` runs, and how they wait.

The API process is one event loop: under load it needs up to one core of
its own (it was measured at about half a core at 13,000 output tokens/s),
and it is on the path of every token. Workers whose threads outnumber the
cores left make every step wait for a descheduled thread (a torch parallel
region ends when its slowest thread does): on 2 CPUs a step of the tiny
checkpoint that takes 1.94 ms offline took ~5 ms served with one thread per
core in each worker. So:

    cores left for workers = cores - the API's core (at least 1)
    split:   every worker gets an equal share of them
    shared:  each engine worker (prefill, decode, pd, aggregated: the ones
             busy at the same time under load) gets an equal share; an
             encoder (niced, busy in bursts) may use all of them

except on a host of `SMALL_HOST_CORES` or fewer, where `epd serve` keeps no
core for its API: there the model is the cost and a kept core is half the
machine (on 2 CPUs the small checkpoint served 1.16x the tokens/s
with both cores in its worker, 1.25-1.30x vLLM's with the short spin below;
vLLM keeps a core for its front end even there). `--threads-per-worker`
overrides the rule.

How waiting threads wait ("shared"): an OpenMP thread whose parallel region
ended spins before it sleeps (libgomp: 300,000 spins by default), and a
spinning thread takes a core another worker or the API needs. `epd serve`
shortens the spin to `SHORT_SPIN` (`GOMP_SPINCOUNT`): long enough that a
worker's threads meet the next region of the same step awake (sleeping at
once, `OMP_WAIT_POLICY=PASSIVE`, made a 2-thread decode 1.3x slower: each of
a step's hundreds of regions woke a sleeping thread), short enough that an
idle one soon yields. `epd worker` sets PASSIVE: its neighbours are unknown
(two busy external workers on two shared cores took 48.1 s for 30 requests
of 200 tokens with the default spin, 3.0 s with PASSIVE). An
operator's own `OMP_WAIT_POLICY` or `GOMP_SPINCOUNT` stands.

With `--core-lease` (the default), the engine workers of one `epd serve` on CPU, "shared", lend
each other their cores while idle (`lease_cores`; transport/host/core_lease.py): before each step a
worker takes every core the busy ones leave it, so e-p-d's decode worker runs
on both cores of a 2-core host while the prefill worker has nothing to do, and
on its even share while both work or while the hypervisor steals the vCPUs
(docs/decisions/cpu-threads.md). `--threads-per-worker` fixes the count.

`epd serve`'s workers and `epd worker` take both from here: `worker_threads`
for the count and `share_cores` for the policy. An `epd worker` is counted as
the one worker of its host (`roles=[role]`) that keeps a core for an API: it
cannot know its neighbours.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

from epd.transport.wire.roles import Role

API_CORES = 1  # kept free for the API process (see SMALL_HOST_CORES)
SMALL_HOST_CORES = 2  # a host with at most this many: `epd serve` gives its workers every core
CPU_SHARING = ("split", "shared")
WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
SPIN_COUNT_ENV = "GOMP_SPINCOUNT"
# spins before a waiting OpenMP thread sleeps (libgomp's default: 300,000). Offline, 2 threads, the
# small checkpoint: 12.8 s spinning (ACTIVE), 13.4 s at 10,000, 16.6 s at 1,000, 17.0 s PASSIVE
SHORT_SPIN = "10000"


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, as taskset or a container sets it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def share_cores(cpu_sharing: str, external: bool = False) -> None:
    """With "shared" cores, the wait of every worker process started from here (this process's
    environment): `epd serve`'s workers spin `SHORT_SPIN` times, an `epd worker` (`external`)
    sleeps at once (`OMP_WAIT_POLICY=PASSIVE`); an operator's own setting of either stands.
    libgomp reads them once, when torch loads it: call this before `import torch` in the
    worker's process or in the process that spawns the workers."""
    if cpu_sharing != "shared" or WAIT_POLICY_ENV in os.environ or SPIN_COUNT_ENV in os.environ:
        return
    if external:
        os.environ[WAIT_POLICY_ENV] = "PASSIVE"
    else:
        os.environ[SPIN_COUNT_ENV] = SHORT_SPIN


def serve_api_cores(num_cores: int) -> int:
    """Cores `epd serve` keeps for its API process on a host of `num_cores`."""
    return 0 if num_cores <= SMALL_HOST_CORES else API_CORES


def worker_cores(num_cores: int, api_cores: int = API_CORES) -> int:
    """The cores of a host of `num_cores` left to its workers, `api_cores` kept for the API (at least one)."""
    return max(1, num_cores - api_cores)


def worker_threads(role: Role | None, roles: Sequence[Role], num_cores: int, cpu_sharing: str,
                   api_cores: int = API_CORES) -> int:
    """Threads of a worker of `role` among `roles` (every worker the launcher
    starts) on `num_cores` cores, `api_cores` of them kept for the API; `role`
    None: those of an engine worker."""
    free = worker_cores(num_cores, api_cores)
    if cpu_sharing == "split":
        return max(1, free // max(1, len(roles)))
    if role is not None and not role.holds_kv:
        return free
    return max(1, free // max(1, sum(r.holds_kv for r in roles)))


def lease_cores(roles: Sequence[Role], num_cores: int, cpu_sharing: str, api_cores: int = API_CORES) -> int | None:
    """The cores the engine workers among `roles` lend each other (transport/host/core_lease.py):
    those left by the API, when "shared" and there are two engine workers or more; else None."""
    if cpu_sharing != "shared" or sum(r.holds_kv for r in roles) < 2:
        return None
    return worker_cores(num_cores, api_cores)
