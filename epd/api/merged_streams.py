"""The orchestrator streams of one HTTP request (its `n` sequences), merged: `MergedStreams`."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from epd.requests import Delta, GenerateRequest

if TYPE_CHECKING:
    from epd.api.orchestrator_like import OrchestratorLike

logger = logging.getLogger(__name__)


class MergedStreams:
    """The orchestrator streams of one HTTP request, merged into (index, Delta) in
    arrival order (`async for`). `open` waits for every first Delta; `aclose` closes them all.
    One stream (n = 1, the usual case) is read directly; n > 1 streams are
    pumped into one queue by a task each."""

    def __init__(self, streams: list[AsyncIterator[Delta]], firsts: list[Delta]):
        self._streams = streams
        self._firsts = firsts
        self._queue: asyncio.Queue = asyncio.Queue()
        self._pumps = [asyncio.create_task(self._pump(i)) for i, d in enumerate(firsts)
                       if d.finish_reason is None] if len(streams) > 1 else []

    @classmethod
    async def open(cls, orchestrator: OrchestratorLike, requests: list[GenerateRequest]) -> MergedStreams:
        streams = [orchestrator.generate(r) for r in requests]
        if len(streams) == 1:  # n = 1: awaited here, no task
            try:
                return cls(streams, [await _first_delta(streams[0])])
            except BaseException:
                await _close_all(streams)
                raise
        tasks = [asyncio.ensure_future(_first_delta(s)) for s in streams]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in tasks:  # the first failure in index order (a RequestError is the same for all)
                if task.done() and task.exception() is not None:
                    raise task.exception()
            return cls(streams, [t.result() for t in tasks])
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await _close_all(streams)
            raise

    @property
    def num_sequences(self) -> int:
        return len(self._streams)

    async def __aiter__(self) -> AsyncIterator[tuple[int, Delta]]:
        """Every (index, Delta), firsts first. One at a time: the Deltas of a reader
        that fell behind are handed over in one pass of the event loop, and their
        writes leave as one (docs/architecture.md, "Batching on the token path")."""
        for item in enumerate(self._firsts):
            yield item
        if not self._pumps:
            if len(self._streams) == 1 and self._firsts[0].finish_reason is None:
                async for delta in self._streams[0]:  # each Delta already holds every token that was here
                    yield 0, delta
            return
        remaining = len(self._pumps)
        while remaining:
            index, item = await self._queue.get()  # no wait while the queue holds any
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item

    async def aclose(self) -> None:
        for pump in self._pumps:
            pump.cancel()  # cancels the stream it is awaiting: its finally runs now
        await asyncio.gather(*self._pumps, return_exceptions=True)
        await _close_all(self._streams)

    async def _pump(self, index: int) -> None:
        try:
            async for delta in self._streams[index]:
                self._queue.put_nowait((index, delta))
            self._queue.put_nowait((index, None))
        except Exception as exc:  # handed to the consumer; cancellation is not
            self._queue.put_nowait((index, exc))


async def _first_delta(stream: AsyncIterator[Delta]) -> Delta:
    try:
        return await anext(stream)
    except StopAsyncIteration:
        raise RuntimeError("orchestrator stream ended without a Delta") from None


async def _close_all(streams: list[AsyncIterator[Delta]]) -> None:
    for stream in streams:
        aclose = getattr(stream, "aclose", None)
        if aclose is None:
            continue
        try:
            await aclose()
        except Exception:
            logger.exception("closing an orchestrator stream failed")
