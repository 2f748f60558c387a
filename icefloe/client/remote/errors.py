"""Reading the service's error bodies and turning HTTP failures into icefloe errors.

The training API answers errors as ``{code, message}``, ``{error}``, FastAPI's ``{detail}``, or
front-door wrappers that embed the backend's JSON in a message string; a chunk-group code can sit
anywhere in that nesting, so :func:`find_error_code` searches it all (to a fixed depth).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

from icefloe import protocol as api

__all__ = ["Redactor", "error_from_failed_request", "error_from_response", "error_message", "find_error_code"]

_MAX_SEARCH_DEPTH: Final = 8
_LEGACY_MISSING_CHUNKS_MESSAGE: Final = "request chunk group is missing chunks"
# The service's wire codes (``icefloe.service.errors``) back to the class the service raised, so a
# remote caller catches what a local one does. Any other code (429, 5xx, the managed endpoint's own
# numeric codes) stays a RequestFailedError.
_CODE_ERRORS: Final[dict[str, type[api.IcefloeError]]] = {
    api.CODE_CHUNK_GROUP_RESTART_REQUIRED: api.ChunkGroupRestartError,
    api.CODE_CHUNK_GROUP_CONFLICT: api.ChunkGroupConflictError,
    api.CODE_CHUNK_GROUP_MISSING_CHUNKS: api.ChunkGroupMissingChunksError,
    api.CODE_INVALID_ARGUMENT: api.InvalidRequestError,
    api.CODE_NOT_FOUND: api.NotFoundError,
    api.CODE_CONFLICT: api.ConflictError,
    api.CODE_SEQUENCE_GAP: api.SequenceGapError,
    api.CODE_UNAUTHENTICATED: api.UnauthenticatedError,
    api.CODE_PAYLOAD_TOO_LARGE: api.PayloadTooLargeError,
    api.CODE_NOT_IMPLEMENTED: api.UnsupportedOpError,
}
# A failed request's ``error`` starts with the class the engine raised ("InvalidRequestError: ..."),
# as icefloe serve writes it; these classes are raised again on the client.
_RAISED_AGAIN: Final = (api.InvalidRequestError, api.ConfigError, api.NotFoundError, api.ConflictError)
_NAMED_ERRORS: Final = {cls.__name__: cls for cls in (*_RAISED_AGAIN, api.UnsupportedOpError, api.WireError)}


def _embedded_json(text: str) -> Any:
    """The JSON object or list inside ``text`` ("...: {json} trailing words"), or None."""
    for start in (text.find("{"), text.find("[")):
        if start >= 0:
            with contextlib.suppress(ValueError):
                return json.JSONDecoder().raw_decode(text, start)[0]
    return None


def _walk(value: Any, depth: int = 0) -> Iterable[dict[str, Any]]:
    """Every dict inside ``value``, outermost first, including JSON embedded in strings."""
    if depth > _MAX_SEARCH_DEPTH:
        return
    if isinstance(value, dict):
        yield value
        for item in value.values():
            yield from _walk(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            yield from _walk(item, depth + 1)
    elif isinstance(value, str) and ("{" in value or "[" in value):
        found = _embedded_json(value)
        if isinstance(found, dict | list):
            yield from _walk(found, depth + 1)


def find_error_code(body: Any) -> str | None:
    """The most specific error code in ``body``: a chunk-group code anywhere wins over an outer code."""
    outer = None
    for node in _walk(body):
        code = node.get("code")
        if isinstance(code, str) and code in api.CHUNK_GROUP_CODES:
            return code
        if node.get("message") == _LEGACY_MISSING_CHUNKS_MESSAGE and "chunk_group_id" in node:
            return api.CODE_CHUNK_GROUP_MISSING_CHUNKS
        if outer is None and isinstance(code, str) and code:
            outer = code
    return outer


def error_message(body: Any, fallback: str) -> str:
    """A one-line human message from any of the error shapes, else ``fallback``."""
    if isinstance(body, dict):
        for key in ("message", "error", "detail"):
            value = body.get(key)
            if isinstance(value, str) and value:
                return value
            if isinstance(value, list) and value:  # FastAPI validation: [{loc, msg, type}]
                parts = [
                    f"{'.'.join(str(p) for p in item.get('loc', ()))}: {item.get('msg', '')}"
                    if isinstance(item, dict)
                    else str(item)
                    for item in value
                ]
                return "; ".join(parts)
            if isinstance(value, dict):
                return error_message(value, fallback)
    if isinstance(body, str) and body.strip():
        return body.strip()
    return fallback


def error_from_response(
    status_code: int, body: Any, *, what: str, request_id: str | None, redactor: Redactor
) -> api.IcefloeError:
    """The typed error for a non-2xx answer (the class its wire code names, else ``RequestFailedError``),
    with the ``status_code`` and ``code`` the retry policy reads."""
    code = find_error_code(body)
    message = redactor(f"{what} failed: {error_message(body, f'HTTP {status_code}')}")
    named = _CODE_ERRORS.get(code or "", api.RequestFailedError)
    if named is api.UnauthenticatedError:  # the service names its header; the user sets one of these
        message += "; give the client one of the service's tokens: ICEFLOE_REMOTE_PAT=TOKEN (icefloe jobs, logs and "
        message += "checkpoints also take --token TOKEN)"
    if issubclass(named, api.RequestFailedError):
        category = "user" if 400 <= status_code < 500 and status_code != 429 else "server"
        return named(message, category=category, status_code=status_code, code=code, request_id=request_id)
    error = (api.ExpiredError if status_code == 410 and named is api.NotFoundError else named)(message)
    error.status_code, error.code = status_code, code
    return error


def error_from_failed_request(what: str, status: str, error: str, *, request_id: str) -> api.IcefloeError:
    """The error for a request that ended ``failed`` or ``cancelled``: the engine's own class when
    ``error`` names one (see ``_NAMED_ERRORS``), else ``RequestFailedError``."""
    name, _, reason = error.partition(": ")
    named = _NAMED_ERRORS.get(name) if status == "failed" else None
    if named is not None:
        return named(f"{what} {status}: {reason}")
    return api.RequestFailedError(f"{what} {status}: {error}", category="server", request_id=request_id)


@dataclass(frozen=True)
class Redactor:
    """Replaces the PAT with ``***`` in any text the remote client raises or logs."""

    secret: str | None = None

    def __call__(self, text: str) -> str:
        return text.replace(self.secret, "***") if self.secret else text
