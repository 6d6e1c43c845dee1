"""A core lease: engine workers on one host lend their cores to each other while idle.

`epd serve` in "shared" mode splits a host's cores evenly over its engine
workers (epd/processes/threads.py): on 2 cores the prefill and the decode worker of
e-p-d run one thread each. Under a text load whose short prompts are prefilled
on the decode worker, the prefill worker idles and half the machine with it
(the decode worker then ran at its one-thread rate). Giving each
worker every core instead was 1.19-1.32x the tokens/s for short prompts and
0.83x for long ones, where both workers are busy and four threads fight for
two cores (docs/benchmarks_archive.md, "e-p-d's start-up, and its decode worker's one thread").
Measured against one fixed thread: 1.32-1.54x for short prompts and level
for long ones on a quiet host, but 0.49x in a window where 45% of the 2
vCPUs' time was stolen by the hypervisor (a parallel region waits for its
slowest thread, and a stolen thread is the slowest).

So each engine worker of `epd serve` (`--core-lease`, the default on CPU)
marks in a small shared file when it steps, and before each step takes
`num_cores // (the engine workers busy now, itself counted)` threads: all of
them while it is the only one working, its even share when the others work
too. Where the host's hypervisor steals more than `STEAL_LIMIT` of its vCPUs'
time (`StealMeter`: /proc/stat's steal column, over `STEAL_WINDOW_S`), a
worker takes its even share only, as with fixed threads, until the steal
falls again. A mark is the monotonic time (system-wide on Linux) of
the worker's latest step; an idle worker clears it, and a mark older than
`STALE_S` counts as idle (a killed worker's mark expires: no release is
needed for safety). A worker whose mark another has not yet seen may run more
threads than its share for one step: the kernel shares them.

The file is `num_slots` float64s, one per engine worker, written with one
aligned 8-byte store each: a reader sees a mark or the one before it.
"""
from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass
from typing import Callable

STALE_S = 10.0  # a mark this old counts as idle: longer than any step, short enough after a crash
STEAL_LIMIT = 0.10  # past this share of the vCPUs' time stolen, no lending (0.49x at 30-45%)
STEAL_WINDOW_S = 2.0  # how often the steal is read again
_MARK = struct.Struct("d")


def read_cpu_times(path: str = "/proc/stat") -> tuple[int, int] | None:
    """(every vCPU's time, the part the hypervisor stole), in jiffies since boot; None
    where the file or its steal column is missing (not Linux, an old kernel)."""
    try:
        with open(path) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    times = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal (guest is in user)
    return sum(times), times[7]


def stolen_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of the vCPUs' time stolen between two `read_cpu_times()`; None if either
    is missing or no time passed."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    return (after[1] - before[1]) / (after[0] - before[0])


class StealMeter:
    """The share of the host's vCPU time stolen by its hypervisor over the latest
    window of `window_s` (0 until a window has passed, and where it cannot be read)."""

    def __init__(self, read: Callable[[], tuple[int, int] | None] = read_cpu_times,
                 window_s: float = STEAL_WINDOW_S, now: float | None = None):
        self._read = read
        self.window_s = window_s
        self._since = time.monotonic() if now is None else now
        self._at_since = read()
        self.share = 0.0

    def update(self, now: float) -> float:
        if now - self._since < self.window_s:
            return self.share
        times = self._read()
        share = stolen_share(self._at_since, times)
        if share is not None:
            self.share = share
        self._since, self._at_since = now, times
        return self.share


def create_lease_file(path: str, num_slots: int) -> None:
    """The lease file of `num_slots` engine workers, every one idle."""
    with open(path, "wb") as f:
        f.write(bytes(_MARK.size * num_slots))


@dataclass(frozen=True)
class CoreShare:
    """One engine worker's place in a host's lease (picklable: it travels in a WorkerLaunch)."""

    path: str  # the lease file (create_lease_file)
    slot: int  # this worker's mark
    num_cores: int  # the cores the engine workers share

    def open(self, set_threads: Callable[[int], None], steal: StealMeter | None = None) -> CoreLease:
        return CoreLease(self, set_threads, steal)


class CoreLease:
    """`take()` before a step, `release()` when the worker has nothing to step.
    `set_threads(n)` is called when the worker's thread count changes
    (torch.set_num_threads in a worker). `steal`: past STEAL_LIMIT the worker
    takes its even share only (None: no such check)."""

    def __init__(self, share: CoreShare, set_threads: Callable[[int], None], steal: StealMeter | None = None):
        self.share = share
        self._set_threads = set_threads
        self._steal = steal
        with open(share.path, "r+b") as f:
            self._marks = mmap.mmap(f.fileno(), 0)
        self.num_slots = len(self._marks) // _MARK.size
        if not 0 <= share.slot < self.num_slots:
            raise ValueError(f"slot {share.slot} is outside the lease file's {self.num_slots} slots")
        self.num_threads = 0  # as last set (0: not yet)
        self._marked = False

    def take(self, now: float | None = None) -> int:
        """Mark this worker busy and set its threads for the step to come; returns them."""
        now = time.monotonic() if now is None else now
        _MARK.pack_into(self._marks, self.share.slot * _MARK.size, now)
        self._marked = True
        if self._steal is not None and self._steal.update(now) > STEAL_LIMIT:
            num_busy = self.num_slots  # lend nothing: a stolen vCPU stalls every thread of a step
        else:
            num_busy = 1 + sum(1 for slot in range(self.num_slots)
                               if slot != self.share.slot and self._is_busy(slot, now))
        num_threads = max(1, self.share.num_cores // num_busy)
        if num_threads != self.num_threads:
            self._set_threads(num_threads)
            self.num_threads = num_threads
        return num_threads

    def release(self) -> None:
        """Mark this worker idle: the others may take its cores."""
        if self._marked:
            _MARK.pack_into(self._marks, self.share.slot * _MARK.size, 0.0)
            self._marked = False

    def _is_busy(self, slot: int, now: float) -> bool:
        (mark,) = _MARK.unpack_from(self._marks, slot * _MARK.size)
        return mark > 0.0 and now - mark < STALE_S

    def close(self) -> None:
        self.release()
        self._marks.close()


def lease_path(run_dir: str) -> str:
    """Where `epd serve` keeps the lease file of a run."""
    return os.path.join(run_dir, "core-lease")
