"""`HttpServer`: uvicorn with EPD's signals, for `epd serve` (epd/serve/launcher.py)
and each API process of `--api-servers N` (epd/serve/api_servers.py)."""
from __future__ import annotations

import asyncio
import contextlib
import signal
import threading

import uvicorn

DRAIN_POLL_S = 0.1  # while draining, look this often whether the requests in flight are done


class HttpServer(uvicorn.Server):
    """uvicorn with EPD's signals. Ctrl-C stops now (open connections get 3 s);
    SIGTERM first drains (`drain`), then stops the same way. Neither signal is
    raised again after the stop (uvicorn's own habit, which for SIGTERM killed
    the process before the launcher could clean up)."""

    def __init__(self, config: uvicorn.Config, drain):
        super().__init__(config)
        self._drain = drain
        self._draining: asyncio.Task | None = None

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        loop = asyncio.get_running_loop()
        originals = {sig: signal.signal(sig, lambda sig, _frame: loop.call_soon_threadsafe(self._on_signal, sig))
                     for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int) -> None:
        if sig == signal.SIGTERM and self.started and self._draining is None:
            self._draining = asyncio.get_running_loop().create_task(self._drain_then_exit())
        elif self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        finally:
            self.should_exit = True
