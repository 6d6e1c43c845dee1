"""A request's token outputs put back in output order."""
from __future__ import annotations

import asyncio

from epd.transport.wire.messages import TokenOutput


class TokenOrder:
    """A request's TokenOutputs in output order. Its tokens come from up to two
    workers (prefill: the first, decode: the rest) over two pipes that the
    collector reads in turn, so a delta can overtake the one before it; each
    waits here until the tokens before it are out. A message without tokens
    (an error) ends the request and is passed on at once, and so is anything
    that is not a TokenOutput (the orchestrator's own events: a worker lost)."""

    def __init__(self, queue: asyncio.Queue):
        self.queue = queue
        self.waiting: dict[int, TokenOutput] = {}  # index of its first token -> delta
        self.next_index = 0
        self._event: object | None = None  # met by next_tokens_nowait; the next next() hands it out

    async def next(self) -> TokenOutput | object:
        if self._event is not None:
            event, self._event = self._event, None
            return event
        while self.next_index not in self.waiting:
            out = await self.queue.get()
            if not isinstance(out, TokenOutput) or not out.token_ids:
                return out
            self.waiting[out.index] = out
        return self._pop()

    def next_nowait(self) -> TokenOutput | object | None:
        """The next output if it is already here (None if not): what a stream
        whose reader fell behind has accumulated, taken without waiting."""
        if self._event is not None:
            event, self._event = self._event, None
            return event
        while self.next_index not in self.waiting:
            if self.queue.empty():
                return None
            out = self.queue.get_nowait()
            if not isinstance(out, TokenOutput) or not out.token_ids:
                return out
            self.waiting[out.index] = out
        return self._pop()

    def next_tokens_nowait(self) -> TokenOutput | None:
        """The next output if it is already here and carries tokens (None if not).
        An event met instead (an error, a lost worker, the deadline) is kept for
        the next `next()`, so accumulated tokens leave before it."""
        out = self.next_nowait()
        if out is None or (isinstance(out, TokenOutput) and out.error is None):
            return out
        self._event = out
        return None

    def _pop(self) -> TokenOutput:
        out = self.waiting.pop(self.next_index)
        self.next_index += len(out.token_ids)
        return out
