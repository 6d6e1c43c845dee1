"""AttemptStream alone, in milliseconds: one attempt's queue in, Deltas out, and
the events that end an attempt (a worker lost, the deadline, an error) at the
point the collector queued them, after the tokens queued before them."""
from __future__ import annotations

import asyncio
import time

import pytest
from transformers import AutoTokenizer

from epd.inputs.media_item import MediaItem
from epd.requests import RequestError
from epd.serve.attempt import Attempt, Lost, Retry
from epd.serve.attempt_stream import AttemptStream
from epd.serve.preparer import Prepared
from epd.serve.registry import WorkerInfo, WorkerRegistry
from epd.serve.worker_metrics import WorkerMetrics
from epd.transport.wire.messages import TokenOutput
from epd.transport.wire.sampling import SamplingParams

PROMPT = [400, 401, 402]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def _stream(tokenizer, images: dict | None = None) -> tuple[AttemptStream, WorkerMetrics, list[int]]:
    prep = Prepared(list(PROMPT), [], [MediaItem(key, data, 0, 0) for key, data in (images or {}).items()], max_tokens=16)
    metrics, released = WorkerMetrics(WorkerRegistry()), []
    stream = AttemptStream(tokenizer, prep, SamplingParams(max_tokens=16), metrics, timeout_s=5.0,
                           release_images=lambda: released.append(1))
    return stream, metrics, released


def _attempt(*queued) -> Attempt:
    worker = WorkerInfo("aggregated-0", "aggregated", "ipc:///unused")
    attempt = Attempt("r", asyncio.Queue(), worker, None, len(PROMPT))
    for item in queued:
        attempt.queue.put_nowait(item)
    return attempt


def _failed(metrics: WorkerMetrics, reason: str) -> bool:
    """Whether one request failed for `reason`, as /metrics says."""
    return f'epd:requests_failed_total{{reason="{reason}"}} 1.0' in metrics.render().decode()


async def _collect(stream: AttemptStream, attempt: Attempt, deadline: float) -> tuple[list, BaseException | None]:
    deltas = []
    try:
        async for delta in stream.run(attempt, deadline):
            deltas.append(delta)
    except (Retry, RequestError) as exc:
        return deltas, exc
    return deltas, None


def test_tokens_queued_before_a_lost_worker_leave_in_one_delta_then_the_attempt_is_retried(tokenizer):
    stream, _, released = _stream(tokenizer)
    attempt = _attempt(TokenOutput("r", [300], index=0, num_cached_tokens=2), TokenOutput("r", [307], index=1),
                       TokenOutput("r", [314], index=2), Lost("aggregated-0"), TokenOutput("r", [321], index=3))
    deltas, error = asyncio.run(_collect(stream, attempt, time.monotonic() + 5))
    assert [d.token_ids for d in deltas] == [[300, 307, 314]]
    assert deltas[0].num_cached_tokens == 2 and deltas[0].finish_reason is None
    assert isinstance(error, Retry) and "aggregated-0" in str(error)
    assert stream.emitted == [300, 307, 314] and attempt.num_emitted == 3 and not attempt.is_finished
    assert released  # prefilled: the request's images were let go


def test_a_retry_resumes_the_same_stream_and_finishes(tokenizer):
    stream, _, _ = _stream(tokenizer)
    first = _attempt(TokenOutput("r", [300], index=0), Lost("aggregated-0"))
    asyncio.run(_collect(stream, first, time.monotonic() + 5))
    second = _attempt(TokenOutput("r", [307], index=0),
                      TokenOutput("r", [314], index=1, finished=True, finish_reason="length"))
    deltas, error = asyncio.run(_collect(stream, second, time.monotonic() + 5))
    assert error is None and [d.token_ids for d in deltas] == [[307, 314]]
    assert deltas[-1].finish_reason == "length" and second.is_finished
    assert stream.emitted == [300, 307, 314]


def test_an_error_before_any_token_is_a_400_naming_the_images_and_after_tokens_an_abort(tokenizer):
    error_out = TokenOutput("r", [], finished=True, finish_reason="error", error="could not be encoded")
    stream, metrics, _ = _stream(tokenizer, images={"h": b"x"})
    deltas, error = asyncio.run(_collect(stream, _attempt(error_out), time.monotonic() + 5))
    assert deltas == [] and isinstance(error, RequestError)
    assert (error.status, error.param, error.message) == (400, "messages", "could not be encoded")
    assert _failed(metrics, "bad_input")
    stream, metrics, _ = _stream(tokenizer)
    deltas, error = asyncio.run(_collect(stream, _attempt(TokenOutput("r", [300], index=0), error_out),
                                         time.monotonic() + 5))
    assert error is None and [d.finish_reason for d in deltas] == [None, "abort"]
    assert _failed(metrics, "worker_error")


def test_the_deadline_fails_the_request_with_a_503(tokenizer):
    stream, metrics, _ = _stream(tokenizer)
    deltas, error = asyncio.run(_collect(stream, _attempt(TokenOutput("r", [300], index=0)), time.monotonic() + 0.05))
    assert [d.token_ids for d in deltas] == [[300]]
    assert isinstance(error, RequestError) and error.status == 503 and "--request-timeout" in error.message
    assert _failed(metrics, "timeout")
