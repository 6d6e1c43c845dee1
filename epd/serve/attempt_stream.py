"""A request's token outputs, attempt after attempt, as `Delta`s: `AttemptStream`.

    TokenOrder            outputs back in output order (two workers, two pipes)   epd/serve/token_order.py
    coalescing            every output already queued goes into one Delta: a reader
                          that fell behind catches up in one step instead of one per token
                          (docs/architecture.md, "Batching on the token path")
    output processor      text deltas, stop strings, logprobs, finish and stop    epd/output_processor.py
                          reasons: the offline LLM's own (one output pipeline)
    events                the deadline (503), a worker lost or a failed step (Retry),
                          an error of the request's own (400, or "abort" once streamed)

The stream lives as long as its request: a retry resumes it where the lost
attempt stopped (prompt + `emitted` go to the new workers, the output
processor carries on).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from epd.output_processor import OutputProcessor
from epd.requests import Delta, RequestError
from epd.serve.attempt import DEADLINE, SHUTDOWN, Attempt, Lost, Retry
from epd.serve.preparer import Prepared
from epd.serve.token_order import TokenOrder
from epd.serve.worker_metrics import WorkerMetrics
from epd.transport.wire.messages import TokenOutput
from epd.transport.wire.sampling import SamplingParams


class AttemptStream:
    """One request's Deltas over its attempts; `run(attempt)` streams one attempt."""

    def __init__(self, tokenizer, prep: Prepared, sampling: SamplingParams, metrics: WorkerMetrics,
                 timeout_s: float, release_images: Callable[[], None]):
        """`release_images`: called at each attempt's first output (prefilled: the
        request's images are no longer needed)."""
        self.prep = prep
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.release_images = release_images
        self.output = OutputProcessor(tokenizer, prep.token_ids, sampling)  # the same for every attempt
        self.num_cached = 0
        self.dispatched_s: float | None = None  # the end of request_queue_time_seconds

    async def run(self, attempt: Attempt, deadline: float) -> AsyncIterator[Delta]:
        """The Deltas of one attempt until its last (finish_reason set); raises Retry
        when its work is lost, RequestError when the request fails."""
        self.dispatched_s = self.dispatched_s or time.monotonic()
        in_order = TokenOrder(attempt.queue)
        # the deadline arrives as an event in the queue: asyncio.wait_for (Python 3.11) can
        # swallow the cancellation that a client leaving delivers, and the request would run on
        timer = asyncio.get_running_loop().call_later(max(0.0, deadline - time.monotonic()),
                                                      attempt.queue.put_nowait, DEADLINE)
        try:
            while True:
                out = await in_order.next()
                if not isinstance(out, TokenOutput) or out.error is not None:
                    yield self._ended(out)  # raises unless tokens were streamed
                    return
                self.release_images()
                if not self.emitted:
                    self.num_cached = out.num_cached_tokens
                delta = self._take(attempt, out, in_order)
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            timer.cancel()

    def _ended(self, out) -> Delta:
        """An event instead of tokens: RequestError or Retry, or (a worker's error
        after tokens were streamed) the last Delta, "abort"."""
        if out is DEADLINE:
            self.metrics.requests_failed["timeout"] += 1
            raise RequestError(status=503, message=f"the request did not finish within "
                               f"--request-timeout ({self.timeout_s:g} s)",
                               type="service_unavailable", retry_after_s=1)
        if out is SHUTDOWN:  # past --shutdown-grace, or Ctrl-C: an OpenAI error, not a cut connection
            self.metrics.requests_failed["shutdown"] += 1
            raise RequestError(status=503, message="the server is shutting down", type="service_unavailable",
                               retry_after_s=5)
        if isinstance(out, Lost):
            raise Retry(f"worker {out.worker_id} is gone", lost=out)
        if out.is_internal_error:
            raise Retry(out.error)
        self.metrics.requests_failed["bad_input" if not self.emitted else "worker_error"] += 1
        if not self.emitted:
            raise RequestError(status=400, message=out.error, param="messages" if self.prep.items else None)
        return Delta("", [], "abort", len(self.prep.token_ids), self.num_cached)

    @property
    def emitted(self) -> list[int]:
        """Every token streamed so far, over all attempts."""
        return self.output.token_ids

    def _take(self, attempt: Attempt, out: TokenOutput, in_order: TokenOrder) -> Delta:
        """`out` and every output already here after it, as one Delta (one SSE event)."""
        output = self.output
        token_ids, logprobs, parts, finish = [], [] if out.logprobs else None, [], None
        while out is not None:
            # an attempt's first output carries the prompt's logprobs; the first attempt's are kept
            # (a resumed one scores a longer prompt)
            step = output.take(out.token_ids, out.logprobs, out.finish_reason if out.finished else None,
                               out.prompt_logprobs)
            parts.append(step.text)
            attempt.num_emitted += len(step.token_ids)
            token_ids += step.token_ids
            if logprobs is not None:
                logprobs += step.logprobs or ()
            finish = step.finish_reason
            if finish is not None:
                attempt.is_finished = out.finished
                break
            out = in_order.next_tokens_nowait()  # an event met instead waits for the next next()
        first = len(output.token_ids) == len(token_ids)  # the sequence's first Delta carries its prompt
        return Delta("".join(parts), token_ids, finish, len(self.prep.token_ids), self.num_cached,
                     logprobs, dispatched_s=self.dispatched_s, stop_reason=output.stop_reason,
                     prompt_token_ids=self.prep.token_ids if first else None,
                     prompt_logprobs=output.prompt_logprobs if first else None)
