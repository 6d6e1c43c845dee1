"""`ShmAllReduce`: the all-reduce of small tensors through shared memory between the ranks of one host.

vLLM's CPU backend sums the row-parallel outputs this way rather than through gloo's TCP
loopback: each rank copies its tensor into its own slot of a shared file (/dev/shm), raises
its sequence number, waits until every rank's has reached it, and adds the slots in rank
order into its output (so every rank gets the same bits). The slots alternate between two
halves by the parity of the call: a rank writing call s + 1 has seen every rank arrive at
call s, so nobody still reads call s - 1's half. A wait spins (yielding the core) until
its deadline; a tensor larger than a slot goes to gloo (comm.py decides).

Rank 0 makes the file before starting the others and unlinks it once every rank has mapped
it (engine/parallel/leader.py): a group killed outright leaves nothing in /dev/shm.

Layout of the file: [size] int64 sequence numbers (one 64-byte line each), then
2 halves x size slots of `slot_bytes`.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

LINE = 64  # bytes between two ranks' sequence numbers: no false sharing
SPINS_BEFORE_YIELD = 64
WATCH_EVERY_S = 0.5  # how often a wait asks `watch` whether the group is still whole
SLOT_BYTES = 4 << 20  # a decode step's [rows, hidden] fits; larger (prefill) sums go through gloo


def shm_path(run_dir: str | Path) -> Path:
    """The group's shared file: in /dev/shm where there is one (memory, not disk)."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(run_dir)
    return base / f"epd-tp-{Path(run_dir).name}"


def file_bytes(size: int, slot_bytes: int) -> int:
    return size * LINE + 2 * size * slot_bytes


def create(run_dir: str | Path, size: int, slot_bytes: int) -> Path:
    """The zeroed file, made by rank 0 before the others start."""
    path = shm_path(run_dir)
    with open(path, "wb") as f:
        f.truncate(file_bytes(size, slot_bytes))
    return path


class ShmAllReduce:
    def __init__(self, path: str | Path, rank: int, size: int, slot_bytes: int, timeout_s: float,
                 watch: Callable[[], None] | None = None):
        """`watch()`: raises when a rank is known gone (called while waiting, every WATCH_EVERY_S)."""
        self.rank, self.size, self.slot_bytes, self.timeout_s = rank, size, slot_bytes, timeout_s
        self.watch = watch
        self.memory = np.memmap(path, dtype=np.uint8, mode="r+", shape=(file_bytes(size, slot_bytes),))
        self.seqs = np.ndarray((size,), dtype=np.int64, buffer=self.memory, strides=(LINE,))
        self.data = torch.from_numpy(self.memory[size * LINE:]).view(2, size, slot_bytes)
        self.calls = int(self.seqs[rank])

    def fits(self, t: torch.Tensor) -> bool:
        return t.is_contiguous() and t.device.type == "cpu" and t.numel() * t.element_size() <= self.slot_bytes

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `t` (a tensor that `fits`), in place; TimeoutError past the deadline."""
        self.calls += 1
        half = self.data[self.calls % 2]
        num_bytes = t.numel() * t.element_size()
        slots = [half[r, :num_bytes].view(t.dtype).view(t.shape) for r in range(self.size)]
        slots[self.rank].copy_(t)
        self.seqs[self.rank] = self.calls  # after the copy: x86 keeps stores in order
        self._wait_all()
        torch.add(slots[0], slots[1], out=t)
        for r in range(2, self.size):
            t.add_(slots[r])
        return t

    def _wait_all(self) -> None:
        seqs, target = self.seqs, self.calls
        spins, deadline, next_watch = 0, None, None
        while seqs.min() < target:
            spins += 1
            if spins % SPINS_BEFORE_YIELD == 0:
                os.sched_yield()
                now = time.monotonic()
                if deadline is None:
                    deadline, next_watch = now + self.timeout_s, now + WATCH_EVERY_S
                if self.watch is not None and now > next_watch:
                    self.watch()
                    next_watch = now + WATCH_EVERY_S
                if now > deadline:
                    late = [r for r in range(self.size) if seqs[r] < target]
                    raise TimeoutError(f"ranks {late} did not reach all-reduce {target} within {self.timeout_s:g} s")
