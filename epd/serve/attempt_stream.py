"""A request's token outputs, attempt after attempt, as `Delta`s: `AttemptStream`.

    TokenOrder            outputs back in output order (two workers, two pipes)   epd/serve/token_order.py
    coalescing            every output already queued goes into one Delta: a reader
                          that fell behind catches up in one step instead of one per token
                          (docs/architecture.md, "Batching on the token path")
    detokenizer           text deltas, stop strings                               epd/detokenizer.py
    logprobs              one entry per token taken
    events                the deadline (503), a worker lost or a failed step (Retry),
                          an error of the request's own (400, or "abort" once streamed)

The stream lives as long as its request: a retry resumes it where the lost
attempt stopped (prompt + `emitted` go to the new workers, the detokenizer
carries on).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from epd.detokenizer import IncrementalDetokenizer
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
        self.detok = IncrementalDetokenizer(tokenizer, prep.token_ids, sampling.skip_special_tokens, sampling.stop,
                                            sampling.include_stop_str_in_output, sampling.min_tokens)
        # an EOS ends a request with stop_reason None; any other stop token names itself (vLLM)
        self.eos_token_id = None if sampling.ignore_eos else tokenizer.eos_token_id
        self.emitted: list[int] = []  # every token streamed so far, over all attempts
        self.prompt_logprobs = None  # the first attempt's (a resumed one scores a longer prompt)
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

    def _take(self, attempt: Attempt, out: TokenOutput, in_order: TokenOrder) -> Delta:
        """`out` and every output already here after it, as one Delta (one SSE event)."""
        detok = self.detok
        token_ids, logprobs, parts, finish = [], [] if out.logprobs else None, [], None
        self.prompt_logprobs = self.prompt_logprobs or out.prompt_logprobs  # with an attempt's first output
        while out is not None:
            new_ids, new_logprobs, num_read = out.token_ids, out.logprobs, detok.num_tokens
            parts.append(detok.push(new_ids))
            if detok.is_stopped:  # tokens after the stop string (held by a stream interval) go
                new_ids = new_ids[:detok.num_tokens - num_read]
                new_logprobs = new_logprobs and new_logprobs[:len(new_ids)]
            attempt.num_emitted += len(new_ids)
            self.emitted += new_ids
            token_ids += new_ids
            if logprobs is not None:
                logprobs += new_logprobs or ()
            finish = "stop" if detok.is_stopped else out.finish_reason if out.finished else None
            if finish is not None:
                parts.append(detok.finish())
                attempt.is_finished = out.finished
                break
            out = in_order.next_tokens_nowait()  # an event met instead waits for the next next()
        first = len(self.emitted) == len(token_ids)  # the sequence's first Delta carries its prompt
        return Delta("".join(parts), token_ids, finish, len(self.prep.token_ids), self.num_cached,
                     logprobs, dispatched_s=self.dispatched_s, stop_reason=self._stop_reason(finish),
                     prompt_token_ids=self.prep.token_ids if first else None,
                     prompt_logprobs=self.prompt_logprobs if first else None)

    def _stop_reason(self, finish: str | None) -> int | str | None:
        """The stop string matched, or the stop token that ended the sequence (not an EOS)."""
        if finish != "stop":
            return None
        if self.detok.is_stopped:
            return self.detok.stop_reason
        last = self.emitted[-1] if self.emitted else None
        return None if last is None or last == self.eos_token_id else last
