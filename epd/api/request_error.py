"""`RequestError`: a request the API refuses, rendered as an OpenAI error body
(epd/api/errors.py). Its own module so every part of the API edge can raise it."""
from __future__ import annotations

_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}


class RequestError(Exception):
    """A request we refuse; rendered as `{"error": {message, type, param, code}}`.

    `status` 422 is folded into 400 (OpenAI never answers 422). `type` follows
    the status unless given: 401 authentication_error, 404 not_found_error,
    other 4xx invalid_request_error, 5xx server_error.
    """

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 code: str | None = None, type: str | None = None, retry_after_s: int | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s  # sent as Retry-After (a 503 the client may try again)
        self.status = 400 if status == 422 else status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _ERROR_TYPES.get(
            self.status, "server_error" if self.status >= 500 else "invalid_request_error")
