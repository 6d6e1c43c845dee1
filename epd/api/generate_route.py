"""POST /v1/chat/completions and /v1/completions: `GenerateRoute`, one plain ASGI app.

Every generated token passes through these two endpoints, so they skip the
per-request machinery of FastAPI and Starlette (the middleware stack,
routing, dependency solving, the request body's second pass, and
StreamingResponse's anyio task group): `epd.api.server` hands them the ASGI
call directly, behind its own `_ApiMiddleware` (request id, API key, 500s).
What they answer is what FastAPI answered:

* the body is decoded and validated by FastAPI's rules
  (`fast_path.parse_json_body`), its errors turned into the same OpenAI 400;
* the answer is JSON or server-sent events with the same headers and bytes
  (`fast_path.SSE_HEADERS`).

A client that goes away is noticed by one listener task per request (the
`http.disconnect` message), which cancels the request's own task: before the
answer started the sequences are closed and nothing is sent; mid-stream the
stream is closed the same way (closing the orchestrator's generators aborts
the request in the workers). `serve` is also what the FastAPI routes call
when a request reaches them (a mounted app, `lean_routes=False`), so both
paths run the same code after parsing.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import anyio
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, TypeAdapter

from epd.api.completions_format import SSE_DONE, ChatFormat, CompletionFormat, Extras, SequenceOutput, sse
from epd.api.errors import error_response, internal_error
from epd.api.fast_path import SSE_HEADERS, header, parse_json_body, read_body
from epd.api.merged_streams import MergedStreams
from epd.api.metrics import ApiMetrics, RequestTracker
from epd.api.protocol import (ChatCompletionRequest, CompletionRequest, GenerateRequest, RequestError,
                              check_max_logprobs, check_max_tokens, check_token_ids, fan_out)

if TYPE_CHECKING:
    from epd.api.orchestrator_like import OrchestratorLike
    from epd.api.settings import ApiSettings

logger = logging.getLogger(__name__)
request_log = logging.getLogger("epd.requests")  # --enable-log-requests (a handler at INFO: server.build_app)
ResponseFormat = ChatFormat | CompletionFormat

REQUEST_ID_KEY = "epd.request_id"  # ASGI scope keys set by server._ApiMiddleware
REQUEST_ID_GENERATED_KEY = "epd.request_id_generated"
ARRIVAL_KEY = "epd.arrival_s"  # time.monotonic() when the request reached the middleware

CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
BODY_MODELS: dict[str, type[BaseModel]] = {CHAT_PATH: ChatCompletionRequest, COMPLETIONS_PATH: CompletionRequest}
_ADAPTERS = {path: TypeAdapter(model) for path, model in BODY_MODELS.items()}  # built once, not per request
MIN_JSON_ITEMS = 1 << 18  # `max_json_items` for models with a short context (~0.6 KB of objects an item)


class GenerateRoute:
    """The ASGI app of the two generation endpoints (POST only; `epd.api.server` routes to it)."""

    def __init__(self, orchestrator: OrchestratorLike, settings: ApiSettings, metrics: ApiMetrics):
        self.orchestrator = orchestrator
        self.settings = settings
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        path = scope["path"]
        body = await read_body(receive)
        if body is None:
            return  # the client left before its body arrived: nobody to answer
        try:
            parsed = parse_body(path, body, header(scope, b"content-type"),
                                max_items=max_json_items(self.orchestrator.max_model_len))
        except RequestError as exc:
            return await error_response(exc)(scope, receive, send)
        await self.serve(parsed, scope, receive, send)

    async def serve(self, body: ChatCompletionRequest | CompletionRequest, scope, receive, send) -> None:
        """Answer one validated request: a RequestError becomes its OpenAI error
        (before the answer started) or an in-band error event (after)."""
        guard = _DisconnectGuard(receive)
        try:
            await self._serve(body, scope, receive, send, guard)
        except RequestError as exc:
            guard.disarm()
            await error_response(exc)(scope, receive, send)
        except asyncio.CancelledError:
            # ours (the client went away; the sequences are closed) and no one else's: done
            if not guard.client_gone or asyncio.current_task().uncancel() > 0:
                raise
        finally:
            guard.disarm()

    async def _serve(self, body, scope, receive, send, guard: _DisconnectGuard) -> None:
        requests, fmt = self._prepare(body, scope)
        for request in requests:
            check_token_ids(request, self.orchestrator.vocab_size)
        # a batch's choices: prompt-major, `n` per prompt (choice i answers prompt i // n)
        sequences = [sequence for request in requests for sequence in fan_out(request)]
        tracker = self.metrics.track(len(sequences), scope.get(ARRIVAL_KEY))
        if not body.stream:
            answer = await _collect(self.orchestrator, sequences, fmt, tracker)
            guard.disarm()
            return await JSONResponse(answer)(scope, receive, send)
        streams = await MergedStreams.open(self.orchestrator, sequences)
        events = _sse_events(streams, fmt, tracker, body.include_usage)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": list(SSE_HEADERS)})
            async for chunk in events:
                last = chunk.endswith(SSE_DONE)  # only the stream's last write ends with [DONE]
                if last:
                    guard.disarm()
                await send({"type": "http.response.body", "body": chunk, "more_body": not last})
        finally:  # however the stream ended (client gone, error): closed, and no cancel from here on
            guard.disarm()
            await events.aclose()

    def _prepare(self, body, scope) -> tuple[list[GenerateRequest], ResponseFormat]:
        """The requests (one per prompt) and the format of their answer."""
        lora = self.settings.adapter(body.model)  # unknown: 404
        model = body.model if lora else self.settings.served_model_name
        decode = token_id_text if body.return_tokens_as_token_ids else self.orchestrator.decode_token
        max_model_len = self.orchestrator.max_model_len
        if type(body) is ChatCompletionRequest:
            if body.max_completion_tokens is not None:
                check_max_tokens(body.max_completion_tokens, "max_completion_tokens", max_model_len)
            else:
                check_max_tokens(body.max_tokens, "max_tokens", max_model_len)
            request_id = internal_request_id(scope, "chatcmpl")
            request = body.to_generate_request(request_id, max_images_per_prompt=self.settings.max_images_per_prompt,
                                               max_videos_per_prompt=self.settings.max_videos_per_prompt,
                                               max_audios_per_prompt=self.settings.max_audios_per_prompt,
                                               defaults=self.settings.sampling_defaults)
            request.lora = lora
            request.session_id = session_id(scope, body)
            self._checked(request, "top_logprobs")
            extras = self._extras(body, request, (body.echo_text(),), role=body.response_role)
            return [request], ChatFormat(request_id, model, int(time.time()), decode, bool(body.logprobs),
                                         extras, tool_choice=request.tool_choice, tools=request.tools,
                                         tool_parser=self.settings.tool_call_parser)
        request_id = internal_request_id(scope, "cmpl")
        check_max_tokens(body.max_tokens, "max_tokens", max_model_len)
        requests = body.to_generate_requests(request_id, defaults=self.settings.sampling_defaults)
        for request in requests:
            request.lora = lora
            request.session_id = session_id(scope, body)
            self._checked(request, "logprobs")
        # vLLM echoes the prompt's text (token ids decoded), and nothing when token ids are returned
        echo = tuple(r.prompt if isinstance(r.prompt, str) else self.orchestrator.detokenize(r.prompt)
                     for r in requests) if body.echo and not body.return_token_ids else ()
        return (requests, CompletionFormat(request_id, model, int(time.time()), decode, body.logprobs is not None,
                                           self._extras(body, requests[0], echo, echo_only=body.echo_only,
                                                        echo_logprobs=bool(body.echo))))

    @staticmethod
    def _extras(body, request: GenerateRequest, echo: tuple[str, ...], role: str = "assistant",
                echo_only: bool = False, echo_logprobs: bool = False) -> Extras:
        return Extras(n=request.sampling.n, return_token_ids=bool(body.return_token_ids),
                      continuous_usage=body.continuous_usage, echo=echo if any(echo) else (), role=role,
                      echo_only=echo_only, echo_logprobs=echo_logprobs)


    def _checked(self, request: GenerateRequest, logprobs_param: str) -> None:
        """--max-logprobs; --enable-log-requests: one line for the request."""
        check_max_logprobs(request, self.settings.max_logprobs, logprobs_param)
        if request.sampling.prompt_logprobs is not None:
            check_max_logprobs(request, self.settings.max_logprobs, "prompt_logprobs", request.sampling.prompt_logprobs)
        if self.settings.log_requests:
            prompt = request.prompt if request.messages is None else request.messages
            request_log.info("request %s: %s %d, sampling %s", request.request_id,
                             "prompt" if request.messages is None else "messages", len(prompt), request.sampling)


class _DisconnectGuard:
    """One task waits for the client's `http.disconnect` and cancels the request's
    task when it comes; `disarm` (before the last write, and at the end) stops it,
    since a finished response also reads as a disconnect."""

    def __init__(self, receive):
        self.client_gone = False
        self._task = asyncio.current_task()
        self._armed = True
        self._listener = asyncio.ensure_future(_wait_for_disconnect(receive))
        self._listener.add_done_callback(self._on_disconnect)

    def _on_disconnect(self, listener: asyncio.Future) -> None:
        if self._armed and not listener.cancelled() and listener.exception() is None:
            self.client_gone = True
            self._task.cancel()

    def disarm(self) -> None:
        if self._armed:
            self._armed = False  # a callback already scheduled does nothing now
            self._listener.cancel()


async def _wait_for_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def max_json_items(max_model_len: int) -> int:
    """Commas and brackets a body may hold: more than any request the model can
    serve needs (a prompt of token ids has one comma a token), few enough that
    the parsed body stays a small multiple of its bytes (docs/architecture.md,
    "What one request may cost")."""
    return max(MIN_JSON_ITEMS, 2 * max_model_len)


def count_json_items(body: bytes) -> int:
    """An upper bound on the values, members and containers in a JSON text (every
    one but the first follows a comma or opens a container; commas and brackets
    inside strings are counted too, which only overestimates)."""
    return body.count(b",") + body.count(b"[") + body.count(b"{")


def check_json_items(body: bytes, max_items: int) -> None:
    """A 413 for a body of more JSON items than `max_items`, before it is parsed
    (a Python object per item costs ~10-70x its JSON bytes)."""
    if count_json_items(body) > max_items:
        raise RequestError(f"the request body holds more than {max_items} JSON items (values, members and "
                           "containers; commas and brackets counted)", status=413, code="request_too_large")


async def read_json_object(request, max_items: int) -> dict:
    """The body of a route declared on FastAPI (tokenizer routes, /v1/responses), bounded
    like the generation endpoints' (`check_json_items`) before it is parsed: a JSON object."""
    body = await request.body()
    check_json_items(body, max_items)
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise RequestError(f"Invalid JSON body: {exc}", code="invalid_json") from None
    if not isinstance(value, dict):
        raise RequestError("The request body must be a JSON object")
    return value


def parse_body(path: str, body: bytes, content_type: str | None,
               max_items: int | None = None) -> ChatCompletionRequest | CompletionRequest:
    """The body of a POST to `path`, as FastAPI would parse it (`fast_path.parse_json_body`).
    `max_items`: a body with more JSON items is refused before it is parsed (`check_json_items`)."""
    if max_items is not None:
        check_json_items(body, max_items)
    return parse_json_body(_ADAPTERS[path], body, content_type)


def session_id(scope, body) -> str | None:
    """The conversation `--router cache_aware` keeps on one worker, keyed as vLLM's router
    keys it: the x-session-id header, else the body's `user`."""
    return header(scope, b"x-session-id") or body.user


def token_id_text(token_id: int) -> str:
    """vLLM's return_tokens_as_token_ids: a logprob token as "token_id:<id>" (any bytes survive JSON)."""
    return f"token_id:{token_id}"


def internal_request_id(scope, prefix: str) -> str:
    """"chatcmpl-<uuid>": the generated x-request-id when the client sent none (one
    id to grep for), otherwise a fresh uuid (client ids need not be unique)."""
    base = scope.get(REQUEST_ID_KEY) if scope.get(REQUEST_ID_GENERATED_KEY) else None
    return f"{prefix}-{base or uuid.uuid4().hex}"


# -- the two answer shapes -------------------------------------------------------------------------

async def _collect(orchestrator: OrchestratorLike, requests: list[GenerateRequest], fmt: ResponseFormat,
                   tracker: RequestTracker) -> dict:
    streams = await MergedStreams.open(orchestrator, requests)
    outputs = [SequenceOutput(i) for i in range(len(requests))]
    try:
        async for index, delta in streams:
            outputs[index].add(delta)
            tracker.on_delta(index, delta)
    finally:
        await streams.aclose()
    return fmt.response(outputs)


async def _sse_events(streams: MergedStreams, fmt: ResponseFormat, tracker: RequestTracker,
                      include_usage: bool) -> AsyncIterator[bytes]:
    """The SSE body, one chunk per Delta (a choice's opening chunks, the chat role, go with
    its first: they carry what only that Delta knows, the prompt's ids and length; the last
    Delta's event with the usage and [DONE]: the last chunk is the one ending with [DONE])."""
    outputs = [SequenceOutput(i) for i in range(streams.num_sequences)]
    events: list[bytes] = []
    opened: set[int] = set()
    num_finished = 0
    try:
        async for index, delta in streams:
            if index not in opened:
                opened.add(index)
                events += [sse(chunk) for chunk in fmt.opening_chunks(index, delta)]
            outputs[index].add(delta)
            tracker.on_delta(index, delta)
            num_finished += delta.finish_reason is not None
            event = fmt.delta_event(index, delta, outputs[index])
            if event:
                events.append(event)
            if events and num_finished < len(outputs):  # the last events go with the usage and [DONE]
                yield b"".join(events)
                events = []
        if include_usage:
            events.append(sse(fmt.usage_chunk(outputs)))
    except RequestError as exc:  # the status is already sent: report in-band, as vLLM does
        events.append(fmt.error_event(exc))
    except Exception:
        logger.exception("request %s failed mid-stream", fmt.request_id)
        events.append(fmt.error_event(internal_error()))
    finally:
        with anyio.CancelScope(shield=True):  # runs even when the client disconnect cancelled us
            await streams.aclose()
    yield b"".join(events) + SSE_DONE


class ServedResponse(Response):
    """What the FastAPI routes return: `GenerateRoute.serve` run as the response
    (the body FastAPI already parsed; the same code as the lean route from there)."""

    def __init__(self, route: GenerateRoute, body: ChatCompletionRequest | CompletionRequest):
        super().__init__()
        self._route = route
        self._body = body

    async def __call__(self, scope, receive, send) -> None:
        await self._route.serve(self._body, scope, receive, send)
