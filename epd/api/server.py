"""The OpenAI-compatible HTTP server: `build_app(orchestrator, settings) -> FastAPI`.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models[/{id}],
GET /health, GET /metrics. The app knows the orchestrator only through
`OrchestratorLike`; one HTTP request with `n` choices becomes `n`
`orchestrator.generate()` streams (see `protocol.fan_out`), merged here.

Streaming answers send no HTTP status until every sequence produced its
first Delta, so input errors the orchestrator finds (bad image bytes, prompt
too long, ...) are still proper 4xx JSON errors. When the client goes away,
streamed or not, the orchestrator's generators are closed (`aclose()`), which
aborts the request in the workers.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Protocol

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from starlette.datastructures import Headers

from epd.api.errors import error_body, error_response, install_error_handlers, internal_error
from epd.api.metrics import ApiMetrics, RequestTracker
from epd.api.protocol import (ChatCompletionRequest, CompletionRequest, Delta, GenerateRequest, RequestError,
                          check_model, check_token_ids, fan_out)
from epd.api.responses import SSE_DONE, ChatFormat, CompletionFormat, SequenceOutput, sse

logger = logging.getLogger(__name__)
ResponseFormat = ChatFormat | CompletionFormat

_REQUEST_ID_KEY = "epd.request_id"  # ASGI scope keys set by _ApiMiddleware
_REQUEST_ID_GENERATED_KEY = "epd.request_id_generated"
_ARRIVAL_KEY = "epd.arrival_s"  # time.monotonic() when the request reached the middleware


@dataclass(frozen=True)
class ApiSettings:
    served_model_name: str
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <api_key>"
    max_images_per_prompt: int | None = None  # None: no limit


class OrchestratorLike(Protocol):
    model_name: str
    max_model_len: int
    vocab_size: int  # token ids a client names must be below it

    def missing_roles(self) -> list[str]:
        """Roles the deployment needs that have no live worker now ([]: healthy)."""
        ...

    def metrics_text(self) -> bytes: ...

    def decode_token(self, token_id: int) -> str: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[Delta]:
        """One sequence; raises RequestError before the first Delta for bad input;
        the last Delta has finish_reason set; aclose() aborts it."""
        ...


class ClientDisconnected(Exception):
    pass


def build_app(orchestrator: OrchestratorLike, settings: ApiSettings) -> FastAPI:
    app = FastAPI(title="EPD OpenAI-compatible server")
    install_error_handlers(app)
    app.add_middleware(_ApiMiddleware, api_key=settings.api_key)
    metrics = ApiMetrics(settings.served_model_name)
    app.state.metrics = metrics
    model = settings.served_model_name
    started = int(time.time())

    @app.get("/health")
    async def health() -> Response:
        missing = orchestrator.missing_roles()
        if not missing:
            return Response(status_code=200)
        error = RequestError(f"no live worker for: {', '.join(missing)}", status=503)
        return JSONResponse({**error_body(error), "missing_roles": missing}, status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        text = metrics.render()
        workers = orchestrator.metrics_text()
        if workers:
            text += workers if workers.endswith(b"\n") else workers + b"\n"
        return Response(content=text, media_type=CONTENT_TYPE_PLAIN_0_0_4)

    def model_card() -> dict:
        return {"id": model, "object": "model", "created": started, "owned_by": "epd", "root": model,
                "parent": None, "max_model_len": orchestrator.max_model_len}

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict:
        check_model(model_id, model)
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        check_model(body.model, model)
        request_id = _internal_request_id(raw, "chatcmpl")
        request = body.to_generate_request(request_id, max_images_per_prompt=settings.max_images_per_prompt)
        fmt = ChatFormat(request_id, model, int(time.time()), orchestrator.decode_token, bool(body.logprobs),
                         tool_choice=request.tool_choice)
        return await _serve(raw, request, fmt, bool(body.stream), body.include_usage)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        check_model(body.model, model)
        request_id = _internal_request_id(raw, "cmpl")
        request = body.to_generate_request(request_id)
        fmt = CompletionFormat(request_id, model, int(time.time()), orchestrator.decode_token,
                               body.logprobs is not None)
        return await _serve(raw, request, fmt, bool(body.stream), body.include_usage)

    async def _serve(raw: Request, request: GenerateRequest, fmt: ResponseFormat, stream: bool,
                     include_usage: bool) -> Response:
        check_token_ids(request, orchestrator.vocab_size)
        sequences = fan_out(request)
        tracker = metrics.track(len(sequences), raw.scope.get(_ARRIVAL_KEY))
        try:
            if not stream:
                return JSONResponse(await _until_disconnect(raw, _collect(orchestrator, sequences, fmt, tracker)))
            streams = await _until_disconnect(raw, MergedStreams.open(orchestrator, sequences))
        except ClientDisconnected:
            return Response(status_code=499)  # nobody reads it; the sequences are closed
        return _ClosingStreamingResponse(_sse_events(streams, fmt, tracker, include_usage),
                                         media_type="text/event-stream")

    return app


# -- merging the n sequences of one request --------------------------------------------------------

class MergedStreams:
    """The orchestrator streams of one HTTP request, merged into (index, Delta) in
    arrival order. `open` waits for every first Delta; `aclose` closes them all.
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

    async def batches(self) -> AsyncIterator[list[tuple[int, Delta]]]:
        """Every (index, Delta) that is here, at least one per batch: a reader
        that fell behind gets what accumulated at once (one write, not one per Delta)."""
        yield list(enumerate(self._firsts))
        if not self._pumps:
            if len(self._streams) == 1 and self._firsts[0].finish_reason is None:
                async for delta in self._streams[0]:  # each Delta already holds every token that was here
                    yield [(0, delta)]
            return
        remaining = len(self._pumps)
        while remaining:
            items = [await self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            batch = []
            for index, item in items:
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    batch.append((index, item))
            if batch:
                yield batch

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


# -- the two answer shapes -------------------------------------------------------------------------

async def _collect(orchestrator: OrchestratorLike, requests: list[GenerateRequest], fmt: ResponseFormat,
                   tracker: RequestTracker) -> dict:
    streams = await MergedStreams.open(orchestrator, requests)
    outputs = [SequenceOutput(i) for i in range(len(requests))]
    try:
        async for batch in streams.batches():
            for index, delta in batch:
                outputs[index].add(delta)
                tracker.on_delta(index, delta)
    finally:
        await streams.aclose()
    return fmt.response(outputs)


async def _sse_events(streams: MergedStreams, fmt: ResponseFormat, tracker: RequestTracker,
                      include_usage: bool) -> AsyncIterator[bytes]:
    """The SSE body: every event that is ready goes out in one write."""
    outputs = [SequenceOutput(i) for i in range(streams.num_sequences)]
    opening = b"".join(sse(chunk) for output in outputs for chunk in fmt.opening_chunks(output.index))
    events: list[bytes] = [opening] if opening else []
    num_finished = 0
    try:
        async for batch in streams.batches():
            for index, delta in batch:
                outputs[index].add(delta)
                tracker.on_delta(index, delta)
                num_finished += delta.finish_reason is not None
                event = fmt.delta_event(index, delta)
                if event:
                    events.append(event)
            if events and num_finished < len(outputs):  # the last events go with the usage and [DONE]
                yield b"".join(events)
                events = []
        if include_usage:
            events.append(sse(fmt.usage_chunk(outputs)))
    except RequestError as exc:  # the status is already sent: report in-band, as vLLM does
        events.append(sse(error_body(exc)))
    except Exception:
        logger.exception("request %s failed mid-stream", fmt.request_id)
        events.append(sse(error_body(internal_error())))
    finally:
        with anyio.CancelScope(shield=True):  # runs even when the client disconnect cancelled us
            await streams.aclose()
    yield b"".join(events) + SSE_DONE


class _ClosingStreamingResponse(StreamingResponse):
    """Closes its body generator however the response ends, on any ASGI server
    (a server speaking ASGI 2.4 stops a stream by raising from send(), which would
    otherwise leave the generator to the garbage collector)."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


async def _until_disconnect(raw: Request, work: Awaitable):
    """Runs `work`, cancelling it (which closes its streams) if the client disconnects first."""
    work_task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait([work_task, listener], return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler itself is cancelled (server shutdown)
        if not work_task.done():
            work_task.cancel()
        listener.cancel()
    if work_task.cancelled() or not work_task.done():
        await asyncio.gather(work_task, return_exceptions=True)
        raise ClientDisconnected()
    return work_task.result()


async def _wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


# -- request ids, API key, last-resort 500 -------------------------------------------------------

def _internal_request_id(raw: Request, prefix: str) -> str:
    """"chatcmpl-<uuid>": the generated x-request-id when the client sent none (one
    id to grep for), otherwise a fresh uuid (client ids need not be unique)."""
    base = raw.scope.get(_REQUEST_ID_KEY) if raw.scope.get(_REQUEST_ID_GENERATED_KEY) else None
    return f"{prefix}-{base or uuid.uuid4().hex}"


class _ApiMiddleware:
    """Pure ASGI (streams and disconnects pass through untouched): echoes or
    generates `x-request-id`, checks the API key on /v1/*, and turns an unhandled
    exception into an OpenAI-style 500 while the response has not started."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope[_ARRIVAL_KEY] = time.monotonic()
        headers = Headers(scope=scope)
        request_id = headers.get("x-request-id")
        scope[_REQUEST_ID_GENERATED_KEY] = request_id is None
        request_id = request_id or uuid.uuid4().hex
        scope[_REQUEST_ID_KEY] = request_id
        started = False

        async def send_with_id(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", request_id.encode("latin-1"))]}
            await send(message)

        if self.api_key is not None and scope["path"].startswith("/v1") and not self._authorized(headers):
            error = RequestError("Incorrect or missing API key: pass Authorization: Bearer <key>",
                                 status=401, code="invalid_api_key")
            return await error_response(error)(scope, receive, send_with_id)
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            logger.exception("unhandled error serving %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            await error_response(internal_error())(scope, receive, send_with_id)

    def _authorized(self, headers: Headers) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self.api_key.encode())
