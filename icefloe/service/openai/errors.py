"""OpenAI's error shape for the endpoint: ``{"error": {"message", "type", "param", "code"}}`` with the
status the service gives the same error elsewhere (:func:`icefloe.service.errors.status_and_body`),
so a tool written for the OpenAI API reads our refusals as it reads OpenAI's."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from icefloe.protocol import IcefloeError, InvalidRequestError, NotFoundError
from icefloe.service.errors import status_and_body

__all__ = ["FieldError", "ModelNotFound", "error_body", "install_error_handlers"]

# OpenAI's error types by status; anything else 4xx is an invalid request.
_TYPES = {401: "authentication_error", 403: "permission_error", 404: "invalid_request_error", 429: "rate_limit_error"}


class FieldError(InvalidRequestError):
    """A request field the endpoint refuses (400), naming it in the answer's ``param``."""

    def __init__(self, param: str, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.openai_code = param, code


class ModelNotFound(NotFoundError):
    """The ``model`` names nothing the caller may use (404 ``model_not_found``, as OpenAI answers)."""

    param, openai_code = "model", "model_not_found"


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = "server_error" if status >= 500 else _TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _validation(exc: RequestValidationError) -> tuple[str, str | None]:
    problems, param = [], None
    for err in exc.errors():
        if err.get("type") == "json_invalid":  # the body is no JSON: its loc is a character offset, not a field
            problems.append(f"the body is not valid JSON: {err.get('ctx', {}).get('error', 'invalid')}")
            continue
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        param = param or where or None
        problems.append(f"{where or 'body'}: {str(err.get('msg', 'invalid')).removeprefix('Value error, ')}")
    return "; ".join(problems)[:2000] or "invalid request body", param


def install_error_handlers(app: FastAPI, public_text: Any) -> None:
    """Every error of ``app`` leaves in OpenAI's shape; ``public_text`` hides the service's folders."""

    async def handle(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, StarletteHTTPException):  # unknown path, wrong method
            return JSONResponse(error_body(exc.status_code, str(exc.detail)), exc.status_code, exc.headers)
        if isinstance(exc, RequestValidationError):
            message, param = _validation(exc)
            return JSONResponse(error_body(400, message, param=param), 400)
        status, body = status_and_body(exc)
        param, code = getattr(exc, "param", None), getattr(exc, "openai_code", None)
        return JSONResponse(error_body(status, public_text(body["message"]), param=param, code=code), status)

    # Exception: a bug, answered by Starlette's outermost layer, which raises it again to the server.
    for kind in (IcefloeError, RequestValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(kind, handle)
