"""`GroupComm`: the collectives of one tensor-parallel group, each with a deadline.

The ranks are processes on one host. They meet through a file store in the
group's run directory (`connect`), then talk through a gloo process group
made for them alone (`torch.distributed.ProcessGroupGloo`, not torch's
default group: several engines, e.g. a test's TP=1 and TP=2, live in one
process), and small all-reduces go through shared memory (shm_allreduce.py). Every
collective waits at most `timeout_s`; a rank that died or
hangs makes the others' next collective fail with `GroupFailed` rather than
wait forever. docs/decisions/tensor-parallelism.md says why gloo.
"""
from __future__ import annotations

import datetime
import time
from pathlib import Path

import torch
import torch.distributed as dist

from epd.engine.parallel.shm_allreduce import ShmAllReduce


class GroupFailed(RuntimeError):
    """The group cannot go on: a rank died, hung past the deadline, or a collective failed.
    Not a step's error: the worker that sees it stops (its supervisor restarts the group)."""


STORE_FILE = "tp-store"


class GroupComm:
    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size
        self.shm: ShmAllReduce | None = None  # small all-reduces through shared memory (shm_allreduce.py)

    @classmethod
    def connect(cls, store, rank: int, size: int, timeout_s: float) -> "GroupComm":
        """Meets the other ranks (each calls this on the group's `open_store`); GroupFailed after
        `timeout_s`, which is also every later collective's deadline."""
        try:
            return cls(dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=timeout_s)), rank, size)
        except RuntimeError as exc:
            raise GroupFailed(f"tensor-parallel rank {rank} of {size} could not meet the others "
                              f"within {timeout_s:g} s: {exc}") from None

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `t`, in place (every rank gets the same bits): through shared
        memory where it fits a slot (every rank decides alike: the same shapes), else gloo."""
        if self.shm is not None and self.shm.fits(t):
            try:
                return self.shm.all_reduce(t)
            except TimeoutError as exc:
                raise GroupFailed(f"tensor-parallel all-reduce on rank {self.rank} of {self.size}: {exc}") from None
        self._wait(self.group.allreduce([t]), "all-reduce")
        return t

    def barrier(self) -> None:
        """Returns once every rank has called it."""
        self._wait(self.group.barrier(), "barrier")

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """On rank 0 every rank's `t` (the same shape on each), in rank order; None on the others."""
        out = [[torch.empty_like(t) for _ in range(self.size)]] if self.rank == 0 else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self._wait(self.group.gather(out, [t], opts), "gather")
        return out[0] if self.rank == 0 else None

    def _wait(self, work, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as exc:
            raise GroupFailed(f"tensor-parallel {what} on rank {self.rank} of {self.size} failed "
                              f"(a rank died or passed the deadline): {exc}") from None


def open_store(run_dir: str | Path, size: int, timeout_s: float):
    """The group's file store in its run directory (each rank opens it; a wait on it ends at `timeout_s`)."""
    store = dist.FileStore(str(Path(run_dir) / STORE_FILE), size)
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store


def wait_for(check, timeout_s: float, what: str, poll_s: float = 0.05) -> None:
    """Polls `check()` (True: done; it raises for a failure) until `timeout_s`; GroupFailed naming `what` after."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise GroupFailed(f"{what}: not done within {timeout_s:g} s")
        time.sleep(poll_s)
