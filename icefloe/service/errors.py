"""The one place that turns exceptions into the wire's ``{code, message}`` error body.

Handlers raise errors from the tree in :mod:`icefloe.protocol`; a service-side refusal is a
:class:`RequestFailedError` carrying its HTTP status and code (built by the helpers below). Anything
else that escapes a handler is a bug in the service and answers 500 ``internal``.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from icefloe.protocol import (
    CODE_CONFLICT,
    CODE_FORBIDDEN,
    CODE_INTERNAL,
    CODE_INVALID_ARGUMENT,
    CODE_NOT_FOUND,
    CODE_NOT_IMPLEMENTED,
    CODE_PAYLOAD_TOO_LARGE,
    CODE_UNAUTHENTICATED,
    CODE_UNAVAILABLE,
    ClientClosedError,
    ConfigError,
    IcefloeError,
    InvalidRequestError,
    JobFailedError,
    RequestFailedError,
    UnsupportedOpError,
    WireError,
)

__all__ = [
    "bad_request",
    "chunk_group_refusal",
    "conflict",
    "error_body",
    "gone",
    "install_error_handlers",
    "not_found",
    "not_implemented",
    "payload_too_large",
    "status_and_body",
    "unauthenticated",
]

_log = logging.getLogger("icefloe.service")

_CODE_BY_STATUS = {
    400: CODE_INVALID_ARGUMENT,
    401: CODE_UNAUTHENTICATED,
    403: CODE_FORBIDDEN,
    404: CODE_NOT_FOUND,
    405: CODE_INVALID_ARGUMENT,
    409: CODE_CONFLICT,
    410: CODE_NOT_FOUND,
    413: CODE_PAYLOAD_TOO_LARGE,
    501: CODE_NOT_IMPLEMENTED,
    503: CODE_UNAVAILABLE,
}


def _refusal(status: int, code: str, message: str, **detail: Any) -> RequestFailedError:
    error = RequestFailedError(message, category="user", status_code=status, code=code)
    error.detail = detail  # extra keys of the error body, e.g. chunk_group_id
    return error


def bad_request(message: str) -> RequestFailedError:
    return _refusal(400, CODE_INVALID_ARGUMENT, message)


def not_found(message: str) -> RequestFailedError:
    return _refusal(404, CODE_NOT_FOUND, message)


def gone(message: str) -> RequestFailedError:
    return _refusal(410, CODE_NOT_FOUND, message)


def conflict(message: str) -> RequestFailedError:
    return _refusal(409, CODE_CONFLICT, message)


def unauthenticated(message: str) -> RequestFailedError:
    return _refusal(401, CODE_UNAUTHENTICATED, message)


def payload_too_large(message: str) -> RequestFailedError:
    return _refusal(413, CODE_PAYLOAD_TOO_LARGE, message)


def not_implemented(message: str) -> RequestFailedError:
    return _refusal(501, CODE_NOT_IMPLEMENTED, message)


def chunk_group_refusal(error_cls: type[RequestFailedError], code: str, message: str, **detail: Any):
    """A 409 chunk-group error whose body carries ``chunk_group_id`` and the chunk indices at fault."""
    error = error_cls(message, category="user", status_code=409, code=code)
    error.detail = detail
    return error


def error_body(code: str, message: str, **detail: Any) -> dict[str, Any]:
    return {"code": code, "message": message, **detail}


def status_and_body(exc: Exception) -> tuple[int, dict[str, Any]]:
    """The status and ``{code, message}`` body an exception leaves a route with."""
    if isinstance(exc, StarletteHTTPException):
        code = _CODE_BY_STATUS.get(exc.status_code, CODE_INTERNAL if exc.status_code >= 500 else CODE_INVALID_ARGUMENT)
        return exc.status_code, error_body(code, str(exc.detail))
    if not isinstance(exc, IcefloeError):
        _log.exception("internal error (a bug in the service)", exc_info=exc)
        return 500, error_body(CODE_INTERNAL, f"{type(exc).__name__}: {exc}")
    return _status_and_body(exc)


def _status_and_body(exc: IcefloeError) -> tuple[int, dict[str, Any]]:
    if isinstance(exc, RequestFailedError) and exc.status_code is not None:
        return exc.status_code, error_body(
            exc.code or _CODE_BY_STATUS.get(exc.status_code, CODE_INTERNAL), exc.reason, **getattr(exc, "detail", {})
        )
    if isinstance(exc, InvalidRequestError | ConfigError | WireError):
        return 400, error_body(CODE_INVALID_ARGUMENT, str(exc))
    if isinstance(exc, UnsupportedOpError):
        return 501, error_body(CODE_NOT_IMPLEMENTED, str(exc))
    if isinstance(exc, JobFailedError | ClientClosedError):  # the job stopped while the call was in flight
        return 409, error_body(CODE_CONFLICT, str(exc))
    _log.error("unmapped service error %s: %s", type(exc).__name__, exc)
    return 500, error_body(CODE_INTERNAL, f"{type(exc).__name__}: {exc}")


def _field_path(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or "body"


def _validation_message(exc: RequestValidationError) -> str:
    lines = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            lines.append(
                f"body is not valid JSON ({err.get('ctx', {}).get('error', 'decode error')}); send a JSON object"
            )
            continue
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        lines.append(f"{_field_path(tuple(err.get('loc', ())))}: {msg}")
    return "; ".join(lines) or "invalid request body"


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers so every error leaves as ``{code, message}`` with its 4xx/5xx status."""

    @app.exception_handler(IcefloeError)
    async def _icefloe_error(_request: Request, exc: IcefloeError) -> JSONResponse:
        status, body = _status_and_body(exc)
        return JSONResponse(body, status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(CODE_INVALID_ARGUMENT, _validation_message(exc)), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _CODE_BY_STATUS.get(exc.status_code, CODE_INTERNAL if exc.status_code >= 500 else CODE_INVALID_ARGUMENT)
        return JSONResponse(error_body(code, str(exc.detail)), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _bug(_request: Request, exc: Exception) -> JSONResponse:
        _log.exception("internal error (a bug in the service)", exc_info=exc)
        return JSONResponse(error_body(CODE_INTERNAL, f"{type(exc).__name__}: {exc}"), status_code=500)
