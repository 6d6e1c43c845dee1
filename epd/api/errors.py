"""OpenAI error bodies, and the handlers that turn every refusal into one.

Clients (the `openai` SDK among them) read `{"error": {"message", "type",
"param", "code"}}`; FastAPI's own `{"detail": ...}` and its 422 never reach
them. Unhandled exceptions become a 500 in the app's middleware (epd/api/server.py).
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from epd.api.protocol import RequestError, request_error_from_validation


def error_body(error: RequestError) -> dict:
    return {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}


def error_response(error: RequestError, headers: dict[str, str] | None = None) -> JSONResponse:
    if error.retry_after_s is not None:
        headers = {**(headers or {}), "retry-after": str(error.retry_after_s)}
    return JSONResponse(error_body(error), status_code=error.status, headers=headers)


def internal_error() -> RequestError:
    """What a client sees of a bug: no message text, no stack trace (both are logged)."""
    return RequestError("The server had an error while processing your request.", status=500)


async def _on_request_error(request: Request, exc: RequestError) -> JSONResponse:
    return error_response(exc)


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    # malformed JSON arrives here too (error type "json_invalid")
    return error_response(request_error_from_validation(exc.errors()))


async def _on_http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # unknown route (404), wrong method (405), ...
    return error_response(RequestError(str(exc.detail), status=exc.status_code), headers=exc.headers)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestError, _on_request_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)
