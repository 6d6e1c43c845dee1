"""The OpenAI-compatible HTTP server: `build_app(orchestrator, settings) -> FastAPI`.

Routes: POST /v1/chat/completions, POST /v1/completions (both served by
`epd.api.generate_route.GenerateRoute`, taken before FastAPI's machinery by
`epd.api.fast_path.FastPathApp`),
GET /v1/models[/{id}], POST /tokenize and /detokenize (epd.api.tokenizer_routes), GET /version,
POST /v1/load_lora_adapter and /v1/unload_lora_adapter (epd.api.lora_routes, with
--allow-runtime-lora-updating),
POST /v1/responses (epd.api.responses_route, on the chat path),
GET /health, GET /metrics. The app knows the
orchestrator only through `OrchestratorLike`; one HTTP request with `n`
choices becomes `n` `orchestrator.generate()` streams (see
`protocol.fan_out`), merged by `merged_streams.MergedStreams`.

Streaming answers send no HTTP status until every sequence produced its
first Delta, so input errors the orchestrator finds (bad image bytes, prompt
too long, ...) are still proper 4xx JSON errors. When the client goes away,
streamed or not, the orchestrator's generators are closed (`aclose()`), which
aborts the request in the workers.
"""
from __future__ import annotations

import logging
import posixpath
import secrets
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from epd.api.body_limit import call_within_limit
from epd.api.errors import error_body, error_response, install_error_handlers, internal_error
from epd.api.fast_path import FastPathApp
from epd.api.lora_routes import add_lora_routes
from epd.api.generate_route import (ARRIVAL_KEY, BODY_MODELS, CHAT_PATH, COMPLETIONS_PATH, REQUEST_ID_GENERATED_KEY,
                                    REQUEST_ID_KEY, GenerateRoute, ServedResponse)
from epd.api.metrics import ApiMetrics
from epd.api.orchestrator_like import OrchestratorLike
from epd.api.protocol import ChatCompletionRequest, CompletionRequest
from epd.api.responses_route import add_responses_route
from epd.api.settings import ApiSettings
from epd.api.tokenizer_routes import add_tokenizer_routes
from epd.requests import RequestError

logger = logging.getLogger(__name__)


def build_app(orchestrator: OrchestratorLike, settings: ApiSettings, *, lean_routes: bool = True,
              lifespan: Callable[[FastAPI], AbstractAsyncContextManager] | None = None) -> FastAPI:
    """`lean_routes=False`: POST /v1/chat/completions and /v1/completions go through
    FastAPI's routing too (the reference the lean route is tested against).
    `lifespan`: FastAPI's (the start-up code's workers, started before the first request)."""
    metrics = ApiMetrics(settings.metrics_model_name or settings.served_model_name)
    generate = GenerateRoute(orchestrator, settings, metrics)
    lean = _with_cors(_ApiMiddleware(generate, settings), settings) if lean_routes else None
    app = FastPathApp(lean, _is_generation_post, title="EPD OpenAI-compatible server", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(_ApiMiddleware, settings=settings)
    if settings.allowed_origins:  # outside the API key: a browser's preflight carries none
        app.add_middleware(CORSMiddleware, **_cors_options(settings))
    if settings.log_requests:
        _log_requests_at_info()
    app.state.metrics = metrics
    _add_health_routes(app, orchestrator, metrics)
    _add_model_routes(app, orchestrator, settings)
    add_tokenizer_routes(app, orchestrator, settings)
    add_responses_route(app, generate)
    if settings.allow_runtime_lora_updating:
        add_lora_routes(app, orchestrator, settings)

    # Declared here for the OpenAPI schema, the 405 of other methods and a mounted app;
    # a POST to either path is taken by `FastPathApp` before FastAPI sees it.
    @app.post(CHAT_PATH)
    async def chat_completions(body: ChatCompletionRequest) -> Response:
        return ServedResponse(generate, body)

    @app.post(COMPLETIONS_PATH)
    async def completions(body: CompletionRequest) -> Response:
        return ServedResponse(generate, body)

    return app


def _is_generation_post(scope) -> bool:
    """A request the lean route (`GenerateRoute` behind `_ApiMiddleware`) takes."""
    return scope["path"] in BODY_MODELS and scope["method"] == "POST" and not scope.get("root_path")


def _add_health_routes(app: FastAPI, orchestrator: OrchestratorLike, metrics: ApiMetrics) -> None:
    """GET /health (503 naming the roles with no live worker) and GET /metrics."""

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


def _add_model_routes(app: FastAPI, orchestrator: OrchestratorLike, settings: ApiSettings) -> None:
    """GET /v1/models (the model, then each adapter with its `parent`, as vLLM lists
    them: --lora-modules, then runtime loads), /v1/models/{id} and /version."""
    model = settings.served_model_name
    started = int(time.time())

    def model_card() -> dict:
        return {"id": model, "object": "model", "created": started, "owned_by": "epd", "root": model,
                "parent": None, "max_model_len": orchestrator.max_model_len,
                # the generation config's defaults in force ({}: vLLM's neutral ones), by vLLM's names
                "default_sampling_params": settings.sampling_defaults.overridden()}

    def adapter_card(name: str) -> dict:
        module = settings.loras.module(name)
        return {"id": name, "object": "model", "created": started, "owned_by": "epd",
                "root": settings.loras.get(name).lora_path, "parent": module.base_model_name or model,
                "max_model_len": None}

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card(), *(adapter_card(name) for name in settings.loras.names)]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict:
        # a path id ("./ckpt", as `epd serve ./ckpt` lists it) may arrive with its dot segments
        # resolved by the client ("/v1/models/./ckpt" -> "/v1/models/ckpt"): the same model
        if posixpath.normpath(model_id) == posixpath.normpath(model):
            return model_card()
        return model_card() if settings.adapter(model_id) is None else adapter_card(model_id)

    @app.get("/version")
    async def version() -> dict:
        return {"version": settings.version}


def _cors_options(settings: ApiSettings) -> dict:
    return {"allow_origins": list(settings.allowed_origins), "allow_methods": list(settings.allowed_methods),
            "allow_headers": list(settings.allowed_headers), "allow_credentials": settings.allow_credentials}


def _with_cors(app, settings: ApiSettings):
    """The lean generation route behind the same CORS headers as the rest (--allowed-origins)."""
    return CORSMiddleware(app, **_cors_options(settings)) if settings.allowed_origins else app


def _log_requests_at_info() -> None:
    """--enable-log-requests: epd.requests' lines reach stderr whatever the root logger's level."""
    request_log = logging.getLogger("epd.requests")
    request_log.setLevel(logging.INFO)
    if not request_log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
        request_log.addHandler(handler)
        request_log.propagate = False


# -- request ids, API key, body size, last-resort 500 --------------------------------------------

class _ApiMiddleware:
    """Pure ASGI (streams and disconnects pass through untouched): echoes or
    generates `x-request-id`, checks the API key on `settings.keyed_paths`, refuses a body past
    `max_body_bytes` with a 413 (epd/api/body_limit.py), and turns an unhandled
    exception into an OpenAI-style 500 while the response has not started."""

    def __init__(self, app, settings: ApiSettings):
        self.app = app
        self.api_key = settings.api_key
        self.keyed_paths = settings.keyed_paths
        self.max_body_bytes = settings.max_request_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope[ARRIVAL_KEY] = time.monotonic()
        request_id = authorization = None
        for name, value in scope["headers"]:  # the first of each, as Starlette's Headers.get (names in lower case)
            if name == b"x-request-id" and request_id is None:
                request_id = value.decode("latin-1")
            elif name == b"authorization" and authorization is None:
                authorization = value.decode("latin-1")
        scope[REQUEST_ID_GENERATED_KEY] = request_id is None
        request_id = request_id or uuid.uuid4().hex
        scope[REQUEST_ID_KEY] = request_id
        request_id_header = (b"x-request-id", request_id.encode("latin-1"))
        started = False

        async def send_with_id(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []), request_id_header]}
            await send(message)

        if self.api_key is not None and scope["path"].startswith(self.keyed_paths) \
                and not self._authorized(authorization or ""):
            error = RequestError("Incorrect or missing API key: pass Authorization: Bearer <key>",
                                 status=401, code="invalid_api_key")
            return await error_response(error)(scope, receive, send_with_id)
        try:
            await call_within_limit(self.app, scope, receive, send_with_id, self.max_body_bytes)
        except Exception:
            logger.exception("unhandled error serving %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            await error_response(internal_error())(scope, receive, send_with_id)

    def _authorized(self, authorization: str) -> bool:
        scheme, _, token = authorization.partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self.api_key.encode())
