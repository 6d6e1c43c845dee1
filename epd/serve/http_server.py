"""`HttpServer`: uvicorn with EPD's signals, and `api_settings`: the app's settings from
the config, for `epd serve` (epd/serve/launcher.py) and each API process of
`--api-servers N` (epd/serve/api_servers.py)."""
from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Awaitable, Callable

import uvicorn

from epd.api.settings import ApiSettings
from epd.config import ServeConfig
from epd.inputs.sampling_defaults import SamplingDefaults

def api_settings(config: ServeConfig, sampling_defaults: SamplingDefaults | None = None) -> ApiSettings:
    """What the HTTP app of `epd serve` serves and whom, from its one config and the
    checkpoint's sampling defaults (the orchestrator's `ModelFiles`; None: neutral)."""
    return ApiSettings(served_model_name=config.model_name, api_key=config.api_key,
                       max_images_per_prompt=config.media.limit_images_per_prompt,
                       max_request_body_bytes=config.limits.max_request_body_bytes,
                       metrics_require_key=config.metrics_require_key, metrics_model_name=config.metrics_model_name,
                       sampling_defaults=sampling_defaults or SamplingDefaults(),
                       max_logprobs=config.max_logprobs, log_requests=config.enable_log_requests,
                       allowed_origins=config.allowed_origins, allowed_methods=config.allowed_methods,
                       allowed_headers=config.allowed_headers, allow_credentials=config.allow_credentials)


class HttpServer(uvicorn.Server):
    """uvicorn with EPD's signals. SIGTERM drains: `drain(grace_s)` refuses new
    requests and lets those in flight finish for `--shutdown-grace`, then ends
    the rest with an OpenAI error; Ctrl-C does the same with no grace. Only
    then does uvicorn stop (open connections get 3 s), so it never has a
    request left to cut off. A second Ctrl-C stops at once. Neither signal is
    raised again after the stop (uvicorn's own habit, which for SIGTERM killed
    the process before the launcher could clean up)."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[float], Awaitable[None]], grace_s: float):
        super().__init__(config)
        self._drain = drain
        self._grace_s = grace_s
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
        if self.started and self._draining is None:
            grace_s = self._grace_s if sig == signal.SIGTERM else 0.0
            self._draining = asyncio.get_running_loop().create_task(self._drain_then_exit(grace_s))
        elif self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True

    async def _drain_then_exit(self, grace_s: float) -> None:
        try:
            await self._drain(grace_s)
        finally:
            self.should_exit = True
