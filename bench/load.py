"""Open-loop load: each request is sent at its arrival time, finished or not the ones before.

`--max-concurrency` caps requests in flight with a semaphore (as in vLLM):
a request whose arrival time has come waits for a free slot, so with a cap
the achieved rate can fall below the requested one. Its `start_s` is when it
was actually sent.
"""
from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from typing import Awaitable, Callable, Sequence, TextIO

from epd.bench.client import RequestResult
from epd.bench.datasets import BenchRequest

SendFn = Callable[[BenchRequest, float], Awaitable[RequestResult]]  # (request, run_start_s) -> result


async def run_load(requests: Sequence[BenchRequest], arrival_times_s: Sequence[float], send: SendFn, *,
                   max_concurrency: int | None = None, progress: bool = True) -> tuple[list[RequestResult], float]:
    """Send every request on its schedule; return the results (in request order) and the run duration.

    The duration runs from the start of the schedule to the end of the last
    request (seconds).
    """
    if len(requests) != len(arrival_times_s):
        raise ValueError(f"{len(requests)} requests but {len(arrival_times_s)} arrival times")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    bar = ProgressBar(len(requests)) if progress else None
    start = time.perf_counter()

    async def one(request: BenchRequest) -> RequestResult:
        async with slots:
            result = await send(request, start)
        if bar is not None:
            bar.advance()
        return result

    tasks = []
    for request, at_s in zip(requests, arrival_times_s):
        delay_s = start + at_s - time.perf_counter()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        tasks.append(asyncio.create_task(one(request)))
    results = await asyncio.gather(*tasks)
    duration_s = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return list(results), duration_s


class ProgressBar:
    """A one-line text progress bar on stderr (redrawn at most ~10 times a second)."""

    def __init__(self, total: int, width: int = 40, stream: TextIO | None = None):
        self.total, self.width = total, width
        self.stream = stream or sys.stderr
        self.done = 0
        self._start = time.perf_counter()
        self._last_draw = 0.0
        self._draw()

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self._last_draw >= 0.1 or self.done >= self.total:
            self._draw()

    def close(self) -> None:
        self._draw()
        self.stream.write("\n")
        self.stream.flush()

    def _draw(self) -> None:
        self._last_draw = time.perf_counter()
        elapsed_s = self._last_draw - self._start
        filled = self.width * self.done // self.total if self.total else self.width
        bar = "#" * filled + "-" * (self.width - filled)
        rate = self.done / elapsed_s if elapsed_s > 0 else 0.0
        self.stream.write(f"\r[{bar}] {self.done}/{self.total} {elapsed_s:6.1f}s {rate:6.2f} req/s")
        self.stream.flush()
