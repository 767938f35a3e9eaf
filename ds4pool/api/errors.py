"""Every error a client sees, in the error format of the API it called.

OpenAI routes: {"error": {"message", "type", "param", "code"}}.
Anthropic routes (/v1/messages*): {"type": "error", "error": {"type", "message"}}.
Unexpected exceptions become a 500 without internals (the traceback goes to the log).
"""

from __future__ import annotations

import logging
import re

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

from ds4pool.errors import ChatTemplateError, ContextLengthError, Ds4poolError
from ds4pool.kv.session import InvalidSessionIdError, SessionBusyError, SessionNotFoundError
from ds4pool.kv.sharing import PrefixNotFoundError
from ds4pool.sched.request import QueueFullError

log = logging.getLogger("ds4pool.api")

OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}
        self.counted = False  # already recorded in the request metrics


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_response(path: str, err: ApiError) -> Response:
    if is_anthropic(path):
        kind = ANTHROPIC_TYPES.get(
            err.status, "invalid_request_error" if err.status < 500 else "api_error"
        )
        body: dict = {"type": "error", "error": {"type": kind, "message": err.message}}
    else:
        kind = OPENAI_TYPES.get(
            err.status, "invalid_request_error" if err.status < 500 else "server_error"
        )
        body = {
            "error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}
        }
    return Response(body, status_code=err.status, headers=err.headers)


def to_api_error(exc: Exception) -> ApiError:
    """Map any exception to the status and one-line message a client should see."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ValidationException):
        return _validation(exc)
    if isinstance(exc, HTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 413:
            detail = "request body is too large"
        if exc.status_code == 500 and detail == "client disconnected prematurely":
            # litestar's error when the client hangs up while sending its body: nobody reads
            # this response, and it is no server error (nginx's 499: client closed request)
            return ApiError(499, "the client closed the connection before sending its body")
        return ApiError(exc.status_code, detail, headers=dict(exc.headers or {}))
    if isinstance(exc, QueueFullError):
        return ApiError(
            429,
            str(exc),
            code=exc.reason,
            headers={"Retry-After": str(max(1, round(exc.retry_after)))},
        )
    if isinstance(exc, InvalidSessionIdError):
        return ApiError(400, str(exc), param="X-Session-Id", code="invalid_session_id")
    if isinstance(exc, SessionNotFoundError):
        return ApiError(404, str(exc), code="session_not_found")
    if isinstance(exc, PrefixNotFoundError):
        return ApiError(404, str(exc), code="prefix_not_found")
    if isinstance(exc, SessionBusyError):
        return ApiError(409, str(exc), code="session_busy")
    if isinstance(exc, ContextLengthError):
        return ApiError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, ChatTemplateError):
        return ApiError(400, str(exc), param="messages", code="chat_template_error")
    if isinstance(exc, RecursionError):  # msgspec on absurdly deep JSON
        return ApiError(400, "request body is nested too deeply")
    if isinstance(exc, (Ds4poolError, ValueError)):
        return ApiError(400, str(exc).splitlines()[0] if str(exc) else "invalid request")
    log.error("unhandled error", exc_info=exc)
    return ApiError(500, "internal server error")


def _validation(exc: ValidationException) -> ApiError:
    extra = exc.extra if isinstance(exc.extra, list) else []
    first = extra[0] if extra and isinstance(extra[0], dict) else {}
    message = str(first.get("message") or exc.detail or "invalid request")
    key = first.get("key")
    # msgspec names the field in its message: "... field `max_tokens`" / "at `$.a.b`"
    named = re.search(r"field `([^`]+)`|at `\$\.([^`]+)`", message)
    if named:
        key = named.group(1) or named.group(2)
    elif key == "data":
        key = None  # litestar's name for the whole body
    if key and key not in message:
        message = f"{message} (field {key!r})"
    return ApiError(400, message, param=key)


def handle_exception(request: Request, exc: Exception) -> Response:
    err = to_api_error(exc)
    state = getattr(request.app.state, "api", None)
    metrics = getattr(state, "metrics", None)
    if metrics is not None and not err.counted:
        metrics.request_failed(request.url.path, err.status)
    return error_response(request.url.path, err)
