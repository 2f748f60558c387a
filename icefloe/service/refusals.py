"""Each 4xx answer logged once, so an operator reading the server's log sees what was refused and why.

The layer runs twice in the stack: outermost, where it sees the answers of the layers in front of the
routes (a missing token, a body too large, a foreign origin), and again inside ``Batches``, where it
sees each part of a batch as if it had come alone (the batch itself answers 200). The inner one marks
the scope it logged, so the outer one, which sees the same request, stays silent: each refusal is one
line. Both run after :class:`RequireToken` has put the caller's tenant in the scope. A line names the
method, the path, the tenant, the status and the answer's message. It never holds the request's body,
its query string or its headers, so no token can reach it; the service's loggers also redact every
configured token (``app._redact``).
"""

from __future__ import annotations

import json
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from icefloe.service.middleware import TENANT_SCOPE_KEY, tenant_of

__all__ = ["LogRefusals"]

_log = logging.getLogger("icefloe.service")
_KEPT_BYTES = 8192  # of a refusal's answer, to find its message; an error body is a short JSON object
_SHOWN_CHARS = 500  # of a message or a path in the log line
_LOGGED_SCOPE_KEY = "icefloe.refusal_logged"  # set on a request's scope once its refusal is logged


class LogRefusals:
    """Log one ``refused`` line for each answer with a 4xx status; pass every message on unchanged."""

    def __init__(self, app: ASGIApp, *, auth_enabled: bool) -> None:
        self.app = app
        self._auth_enabled = auth_enabled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0
        kept = bytearray()

        async def watching(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and 400 <= status < 500 and len(kept) < _KEPT_BYTES:
                kept.extend(message.get("body", b"")[: _KEPT_BYTES - len(kept)])
            await send(message)

        try:
            await self.app(scope, receive, watching)
        finally:
            if 400 <= status < 500 and not scope.get(_LOGGED_SCOPE_KEY):
                scope[_LOGGED_SCOPE_KEY] = True
                _log.warning(
                    "refused %s %s (tenant %s): %d %s",
                    scope.get("method", "?"),
                    _shown(scope.get("path", "")),
                    self._tenant(scope),
                    status,
                    _shown(_message(bytes(kept))),
                )

    def _tenant(self, scope: Scope) -> str:
        if self._auth_enabled and TENANT_SCOPE_KEY not in scope:
            return "unknown (no valid token)"
        return tenant_of(scope)


def _message(body: bytes) -> str:
    """The message of an error body: ``message`` (icefloe's shape), ``error`` (the Tinker API's; the
    OpenAI API's holds its ``message``) or ``detail`` (the framework's); else the start of the body as text."""
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        parsed = parsed["error"]
    if isinstance(parsed, dict):
        for key in ("message", "error", "detail"):
            if key in parsed:
                return str(parsed[key])
    return body.decode("utf-8", errors="replace") or "(no body)"


def _shown(text: str) -> str:
    """``text`` on one line (control characters escaped, so a caller cannot forge log lines), cut short."""
    escaped = "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode() for ch in text)
    return escaped if len(escaped) <= _SHOWN_CHARS else escaped[:_SHOWN_CHARS] + "..."
