"""The one place that turns exceptions into the wire's ``{code, message}`` error body and its status.

Domain code raises errors from :mod:`icefloe.protocol` and never names an HTTP status;
:func:`status_and_body` maps each class to its status and code, for the route handlers and the ASGI
layers alike. Anything else that escapes is a bug in the service and answers 500 ``internal``.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from icefloe import protocol as p
from icefloe.service.limits import truncated

__all__ = ["install_error_handlers", "retried", "send_error", "status_and_body"]

_log = logging.getLogger("icefloe.service")

# Most specific first: the first class an error is an instance of decides its status and code.
_STATUS_AND_CODE = (
    (p.ChunkGroupRestartError, 409, p.CODE_CHUNK_GROUP_RESTART_REQUIRED),
    (p.ChunkGroupConflictError, 409, p.CODE_CHUNK_GROUP_CONFLICT),
    (p.ChunkGroupMissingChunksError, 409, p.CODE_CHUNK_GROUP_MISSING_CHUNKS),
    (p.SequenceGapError, 409, p.CODE_SEQUENCE_GAP),
    (p.PayloadTooLargeError, 413, p.CODE_PAYLOAD_TOO_LARGE),
    (p.InvalidRequestError | p.ConfigError | p.WireError, 400, p.CODE_INVALID_ARGUMENT),
    (p.UnauthenticatedError, 401, p.CODE_UNAUTHENTICATED),
    (p.MisdirectedRequestError, 421, p.CODE_MISDIRECTED_REQUEST),
    (p.ForbiddenError, 403, p.CODE_FORBIDDEN),
    (p.TooManyRequestsError, 429, p.CODE_TOO_MANY_REQUESTS),
    (p.ExpiredError, 410, p.CODE_NOT_FOUND),
    (p.NotFoundError, 404, p.CODE_NOT_FOUND),
    (p.ConflictError | p.JobFailedError | p.ClientClosedError, 409, p.CODE_CONFLICT),  # the job stopped under the call
    (p.UnsupportedOpError, 501, p.CODE_NOT_IMPLEMENTED),
)
_CODE_BY_STATUS = {401: p.CODE_UNAUTHENTICATED, 404: p.CODE_NOT_FOUND}
# The bug a handler logged for this request: Starlette re-raises it past a mounted app to the app
# around it, whose handler meets it again and must not log it twice.
_LOGGED_BUG_SCOPE_KEY = "icefloe.logged_bug"


def _status_and_code(exc: BaseException) -> tuple[int, str] | None:
    """The status and code of a domain error; None for anything else (a bug: 500)."""
    if isinstance(exc, p.IcefloeError):
        for kind, status, code in _STATUS_AND_CODE:
            if isinstance(exc, kind):
                return status, code
    return None


def status_and_body(exc: Exception, *, log_bug: bool = True) -> tuple[int, dict[str, Any]]:
    """The status and ``{code, message}`` body (plus the error's ``detail``) an exception answers with;
    a bug (500) is logged unless ``log_bug`` is False."""
    known = _status_and_code(exc)
    if known is not None:
        message = exc.reason if isinstance(exc, p.RequestFailedError) else str(exc)
        return known[0], {"code": known[1], "message": message, **getattr(exc, "detail", {})}
    if log_bug:
        _log.error("internal error (a bug in the service)", exc_info=exc)
    return 500, {"code": p.CODE_INTERNAL, "message": f"{type(exc).__name__}: {exc}"}


def retried(exc: BaseException) -> bool:
    """True for an error whose answer a client retries as it was (a 5xx, a 429, or a chunk group to
    restart): the call keeps its place in line for the retry. Framework errors (a malformed body,
    an unknown path) are the caller's mistake and never retried."""
    if isinstance(exc, RequestValidationError | StarletteHTTPException):
        return getattr(exc, "status_code", 400) >= 500
    known = _status_and_code(exc)
    return known is None or known[0] >= 500 or known[0] == 429 or isinstance(exc, p.ChunkGroupRestartError)


async def send_error(scope: Scope, receive: Receive, send: Send, exc: Exception, *, close: bool = False) -> None:
    """Answer ``exc`` from an ASGI layer as a route of the app the request is in (``scope["app"]``)
    would: by that app's error rules (an API's own shape and statuses), else as ``{code, message}``;
    ``close``: the body was not read, so the connection cannot carry another request."""
    handler = _handler_of(scope.get("app"), exc)
    if handler is not None:
        response = await handler(Request(scope, receive), exc)
    else:
        status, body = status_and_body(exc)
        response = JSONResponse(body, status)
    if close:
        response.headers["connection"] = "close"
    await response(scope, receive, send)


def _handler_of(app: Any, exc: Exception) -> Any:
    """The exception handler ``app`` registered for ``exc``'s class or its nearest base, if any."""
    handlers = getattr(app, "exception_handlers", {})
    return next((handlers[kind] for kind in type(exc).__mro__ if kind in handlers), None)


def _validation_message(exc: RequestValidationError) -> str:
    lines = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            problem = err.get("ctx", {}).get("error", "decode error")
            lines.append(f"body is not valid JSON ({problem}); send a JSON object")
            continue
        where = ".".join(str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path", "header"))
        lines.append(f"{where or 'body'}: {str(err.get('msg', 'invalid')).removeprefix('Value error, ')}")
    return truncated(lines) or "invalid request body"


def install_error_handlers(app: FastAPI, *, conflict_status: int = 409) -> None:
    """Register the handlers so every error leaves as ``{code, message}`` with its status;
    ``conflict_status``: the status of a 409 on this app (an API whose clients retry every 409 wants 400)."""

    async def _error(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, StarletteHTTPException):  # the framework's own: unknown paths, wrong methods
            fallback = p.CODE_INTERNAL if exc.status_code >= 500 else p.CODE_INVALID_ARGUMENT
            body = {"code": _CODE_BY_STATUS.get(exc.status_code, fallback), "message": str(exc.detail)}
            return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)
        if isinstance(exc, RequestValidationError):
            return JSONResponse({"code": p.CODE_INVALID_ARGUMENT, "message": _validation_message(exc)}, status_code=400)
        logged = request.scope.get(_LOGGED_BUG_SCOPE_KEY) is exc
        status, body = status_and_body(exc, log_bug=not logged)
        if status == 500:
            request.scope[_LOGGED_BUG_SCOPE_KEY] = exc
        if status == 409:
            status = conflict_status
        settings = getattr(request.app.state, "settings", None)
        if settings is not None:  # an engine's error may name the service's folders: named, not spelled out
            body["message"] = settings.public_text(body["message"])
        return JSONResponse(body, status_code=status)

    # Exception: a bug; Starlette answers with this handler, then re-raises.
    for kind in (p.IcefloeError, RequestValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(kind, _error)
