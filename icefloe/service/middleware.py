"""The pure-ASGI layers in front of an API's routes: the token (or a dashboard login) and its tenant,
the body-size cap, ``Idempotency-Key`` replay and the JSON-body bounds.

The token is checked first, from the headers alone, so an unauthenticated request never has its
body read or parsed and never reaches a later layer or a route (the ``Icefloe-Sequence`` order
among them). Each API says how its callers present the token in its own :class:`Access`;
:mod:`icefloe.service.edge` stacks the layers in order.
Pure ASGI (not ``BaseHTTPMiddleware``) keeps the per-request cost to a few attribute reads, which
matters for the latency of small ops such as ``step``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from starlette.requests import cookie_parser
from starlette.responses import RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from icefloe.protocol import (
    ConflictError,
    ForbiddenError,
    IcefloeError,
    InvalidRequestError,
    PayloadTooLargeError,
    TooManyRequestsError,
    UnauthenticatedError,
)
from icefloe.service import store
from icefloe.service.errors import send_error
from icefloe.service.limits import CHECK_ON_LOOP_BYTES, MAX_JSON_BYTES, check_counts
from icefloe.service.logins import SESSION_COOKIE, Logins
from icefloe.service.origins import foreign_origin
from icefloe.service.schemas import parse_json_body
from icefloe.service.settings import SHARED_TENANT, ServeSettings


class Sequencing(Protocol):
    """What a layer here tells the ``Icefloe-Sequence`` order (:class:`~icefloe.service.sequencing.Sequencing`,
    which reads the caller this module records: so it imports this module, never the other way)."""

    def refused(self, scope: Scope, refusal: Exception) -> None: ...


__all__ = [
    "ACCEPTED_HEADER",
    "CALLER_SCOPE_KEY",
    "OPEN_PATH",
    "OPEN_PREFIX",
    "PAT_TOKEN_TYPE",
    "TENANT_SCOPE_KEY",
    "Access",
    "BodyLimit",
    "IdempotencyKeys",
    "JsonBodies",
    "Recorder",
    "RequireToken",
    "caller_of",
    "header",
    "is_json",
    "matching_token",
    "read_body",
    "replaying",
    "tenant_of",
    "training_access",
]

PAT_TOKEN_TYPE = "PROGRAMMATIC_ACCESS_TOKEN"
# Answered without a token: liveness, and checkpoint downloads (the token in their URL is the credential).
OPEN_PATH, OPEN_PREFIX = "/health", "/files/"
# The dashboard's login form and its static files (no data in them) are open; its pages and data need the token.
UI_OPEN_PATHS, UI_OPEN_PREFIX = ("/ui/login",), "/ui/static/"
# Set by RequireToken on each request it let in: a hash of the caller's token ('' with auth off; absent: an open path).
CALLER_SCOPE_KEY = "icefloe.caller"
TENANT_SCOPE_KEY = "icefloe.tenant"  # set by RequireToken: the caller's tenant (absent: the shared one, no auth)
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

_IDEMPOTENCY_HEADER = b"idempotency-key"
_MAX_KEY_LENGTH = 255
_ONE_BUFFER_FROM_BYTES = 1024 * 1024  # smaller bodies are joined from their chunks: the copy is cheap
_PURGE_EVERY_S = 300.0  # at most this often, a kept reply also sweeps expired records out (off the loop)

# Set by a route on an answer that carries more than it accepted (a ?wait= answer with its result): the JSON of
# what it accepted ({request_id, job_id}), which IdempotencyKeys keeps instead of a large answer. Never sent.
ACCEPTED_HEADER = "icefloe-accepted"
_ACCEPTED_KEY = ACCEPTED_HEADER.encode()

_log = logging.getLogger("icefloe.service")


def header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


async def read_body(
    receive: Receive,
    max_bytes: int | None = None,
    *,
    head_bytes: int = 0,
    check_head: Callable[[bytes], None] | None = None,
    drain: bool = False,
    declared: int | None = None,
) -> bytes | bytearray | None:
    """The whole body, or None when the client went away; its first ``head_bytes`` bytes go to
    ``check_head`` as soon as they arrive. A body that came in one message is that message's bytes, as
    they came; one of several is gathered in :class:`_Arriving`, where ``declared`` (its
    ``Content-Length``) lets a large body be held at most 1.5 times while it arrives instead of twice.

    A refusal (:class:`PayloadTooLargeError` past ``max_bytes``, or the error ``check_head`` raises) is
    raised at once, or with ``drain`` once the rest of the body was read and dropped, never kept: the
    connection stays usable and the client reads the answer instead of a reset (the outer
    :class:`BodyLimit` and the body read timeout bound what is dropped).
    """
    first: bytes | None = None  # the body while it is one message
    arriving: _Arriving | None = None
    seen, head, refusal, more = 0, b"", None, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk, more = message.get("body", b""), message.get("more_body", False)
        seen += len(chunk)
        if refusal is not None:
            continue  # refused: read on only to discard
        if len(head) < head_bytes:
            head += chunk[: head_bytes - len(head)]
        try:
            if check_head is not None and head and (len(head) == head_bytes or not more):
                check_head(head)
                check_head = None
            if max_bytes is not None and seen > max_bytes:
                raise PayloadTooLargeError(
                    f"request body exceeds {max_bytes} bytes, the cap on this route: split it into several requests"
                )
        except IcefloeError as refused:
            if not drain:
                raise
            refusal, first, arriving = refused, None, None
            continue
        if arriving is None:
            if first is None:
                first = chunk
                continue
            arriving = _Arriving(declared)  # a second message: the body is gathered from here on
            arriving.add(first)
            first = None
        arriving.add(chunk)
    if refusal is not None:
        raise refusal
    return arriving.whole() if arriving is not None else first


class _Arriving:
    """A body as its chunks arrive. Chunks joined at the end hold it twice; a buffer of its declared length
    made up front would let a client that sends nothing hold that much. So the chunks are kept until half
    the declared length has come, then copied into one buffer of that length, where the rest goes."""

    def __init__(self, declared: int | None) -> None:
        self.declared = declared if declared is not None and declared > _ONE_BUFFER_FROM_BYTES else None
        self.chunks: list[bytes] = []
        self.buffer: bytearray | None = None
        self.size = 0

    def add(self, chunk: bytes) -> None:
        end = self.size + len(chunk)
        if self.buffer is not None and end <= len(self.buffer):
            self.buffer[self.size : end] = chunk
        else:  # a body longer than it declared (the server refuses one) stays chunks
            self.chunks.append(chunk)
        self.size = end
        if self.buffer is None and self.declared is not None and self.declared // 2 <= end <= self.declared:
            self.buffer, at = bytearray(self.declared), 0
            for index, part in enumerate(self.chunks):  # each dropped once copied
                self.buffer[at : at + len(part)] = part
                at += len(part)
                self.chunks[index] = b""
            self.chunks.clear()

    def whole(self) -> bytes | bytearray:
        if self.buffer is None:
            return b"".join(self.chunks)
        if self.chunks or self.size != len(self.buffer):
            return bytes(self.buffer[: min(self.size, len(self.buffer))]) + b"".join(self.chunks)
        return self.buffer


def replaying(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app the body already read, then waits on the real one (a disconnect)."""
    delivered = False

    async def replay() -> Message:
        nonlocal delivered
        if delivered:
            return await receive()
        delivered = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def _refuse(
    scope: Scope,
    receive: Receive,
    send: Send,
    refusal: Exception,
    sequencing: Sequencing | None,
    *,
    close: bool = False,
) -> None:
    """Answer a layer's refusal as :func:`send_error` does; with ``sequencing`` (an API whose routes take
    ``Icefloe-Sequence`` turns), a numbered POST first uses or keeps its number as a route's refusal would."""
    if sequencing is not None:
        sequencing.refused(scope, refusal)
    await send_error(scope, receive, send, refusal, close=close)


class Recorder:
    """A ``send`` that records an app's answer (status, headers, body) and passes it on to ``send``, if given."""

    def __init__(self, send: Send | None = None, *, keep_from_status: int = 0) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.parts: list[bytes] = []  # the body, kept only when the status is keep_from_status or above
        self._send = send
        self._keep_from_status = keep_from_status

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status, self.headers = message["status"], list(message.get("headers", ()))
        elif message["type"] == "http.response.body" and self.status >= self._keep_from_status:
            self.parts.append(message.get("body", b""))
        if self._send is not None:
            await self._send(message)

    @property
    def body(self) -> bytes:
        return b"".join(self.parts)


def _never(path: str) -> bool:
    return False


@dataclass(frozen=True)
class Access:
    """An API's auth adapter for :class:`RequireToken`: how its callers present their token, besides
    ``Authorization: Bearer``, and which of its paths need none."""

    api_key_header: bytes | None = None  # a header carrying the bare token (the Tinker SDK's x-api-key)
    open_path: Callable[[str], bool] = _never  # answered without a token
    dashboard_page: Callable[[str], bool] | None = None  # with a dashboard: its pages (a login cookie works)


def training_access(settings: ServeSettings) -> Access:
    """The training API's and the dashboard's: a bearer token or a dashboard login. Open: liveness,
    checkpoint downloads, the login form and its static files, ``/metrics`` when public."""

    def open_path(path: str) -> bool:
        return (
            path == OPEN_PATH
            or path.startswith((OPEN_PREFIX, UI_OPEN_PREFIX))
            or path in UI_OPEN_PATHS
            or (path == "/metrics" and settings.metrics_public)
        )

    return Access(open_path=open_path, dashboard_page=_is_page)


def caller_of(token: str) -> str:
    """How a caller is recorded: a hash of its token, never the token."""
    return hashlib.sha256(b"icefloe-caller\0" + token.encode()).hexdigest()


def tenant_of(scope: Scope) -> str:
    """The tenant of a request (the shared one when auth is off)."""
    return scope.get(TENANT_SCOPE_KEY, SHARED_TENANT)


def _authenticate(tokens: list[tuple[str, str]], authorization: str | None, token_type: str | None) -> tuple[str, str]:
    """The configured (token, tenant) the caller presented; :class:`UnauthenticatedError` otherwise.

    Accepts ``Authorization: Bearer <token>``, optionally with the PAT form's
    ``X-Snowflake-Authorization-Token-Type: PROGRAMMATIC_ACCESS_TOKEN``.
    """
    scheme, _, presented = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        raise UnauthenticatedError("missing bearer token; send 'Authorization: Bearer <token>'")
    if token_type not in (None, PAT_TOKEN_TYPE):
        raise UnauthenticatedError(f"X-Snowflake-Authorization-Token-Type must be {PAT_TOKEN_TYPE} when sent")
    matched = matching_token(tokens, presented.strip())
    if matched is None:
        raise UnauthenticatedError("the bearer token is not valid for this service")
    return matched


def matching_token(tokens: list[tuple[str, str]], presented: str) -> tuple[str, str] | None:
    """The (token, tenant) among ``tokens`` whose token equals ``presented``, or None; every token is
    compared, so the time taken says nothing about which one matched."""
    matched = None
    for pair in tokens:
        if hmac.compare_digest(presented.encode(), pair[0].encode()):
            matched = pair
    return matched


class RequireToken:
    """401 from the headers alone, before any body is read, unless the request carries a configured token.

    Every path needs the token but those the API's :class:`Access` opens. The token comes as
    ``Authorization: Bearer`` or in the API's own header. Where the API has a dashboard, a browser that
    logged in to it sends the cookie of its session (:mod:`icefloe.service.logins`) instead of a
    token, and a dashboard page without one is redirected to the login form. A change (any method but
    GET / HEAD / OPTIONS) that only the cookie authenticates must come from the service's own origin (its
    ``Origin`` header) or carry the session's CSRF token (``X-CSRF-Token``): a page elsewhere, on another
    port of the same host included, cannot act through the cookie. A wrong token counts against its client address in
    :class:`Logins`, which past its cap refuses that address (429) before looking at the token. A
    refusal closes the connection, since the body it did not read cannot be skipped. An accepted
    caller is recorded in the scope as a hash of its token (:data:`CALLER_SCOPE_KEY`), which the
    later layers scope their records by, and its tenant (:data:`TENANT_SCOPE_KEY`); with auth off
    every caller is ``''`` of the shared tenant. A request to an open path has no caller.
    """

    def __init__(self, app: ASGIApp, *, settings: ServeSettings, logins: Logins, access: Access) -> None:
        self.app = app
        self.settings = settings
        self.logins = logins
        self.access = access
        self._tokens = settings.token_tenants()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if scope["type"] == "http" and not self.settings.auth_enabled:
            scope[CALLER_SCOPE_KEY] = ""  # every caller is the one shared caller
        elif scope["type"] == "http" and not self.access.open_path(path):
            try:
                scope[CALLER_SCOPE_KEY], scope[TENANT_SCOPE_KEY] = self._caller(scope)
            except (UnauthenticatedError, ForbiddenError, TooManyRequestsError) as refused:
                page = self.access.dashboard_page
                if isinstance(refused, UnauthenticatedError) and page is not None and page(path):
                    await RedirectResponse("/ui/login", 303)(scope, receive, send)  # a dashboard page: log in
                else:
                    await send_error(scope, receive, send, refused, close=True)
                return
        await self.app(scope, receive, send)

    def _caller(self, scope: Scope) -> tuple[str, str]:
        """(caller, tenant) of the request, from its token, or else from its dashboard session."""
        authorization = header(scope, b"authorization")
        api_key = header(scope, self.access.api_key_header) if self.access.api_key_header else None
        if authorization is None and api_key is not None:
            authorization = b"Bearer " + api_key
        cookies = header(scope, b"cookie") if self.access.dashboard_page is not None else None
        if authorization is None and cookies:  # a browser after the login form
            session_id = cookie_parser(cookies.decode("latin-1")).get(SESSION_COOKIE)
            session = self.logins.get(session_id) if session_id else None
            if session is not None:
                if scope["method"] not in _SAFE_METHODS and not self._same_origin(scope, session.csrf_token):
                    raise ForbiddenError(
                        "a change made through the dashboard's login cookie must come from the dashboard's own page "
                        "(its Origin) or carry its X-CSRF-Token; send the token in an Authorization header instead"
                    )
                return session.caller, session.tenant
        token_type = header(scope, b"x-snowflake-authorization-token-type")
        peer = scope["client"][0] if scope.get("client") else ""
        if authorization is not None:  # a guess: refused unread once its address made too many
            self.logins.check(peer)
        try:
            token, tenant = _authenticate(self._tokens, _text(authorization), _text(token_type))
        except UnauthenticatedError:
            if authorization is not None:
                self.logins.failed(peer)
            raise
        return caller_of(token), tenant

    def _same_origin(self, scope: Scope, csrf_token: str) -> bool:
        sent_token = header(scope, b"x-csrf-token")
        if sent_token is not None and hmac.compare_digest(sent_token, csrf_token.encode()):
            return True
        return header(scope, b"origin") is not None and foreign_origin(scope, self.settings.public_url) is None


def _is_page(path: str) -> bool:
    return path == "/ui" or (path.startswith("/ui/") and not path.startswith("/ui/api/"))


class BodyLimit:
    """413 before reading a body whose Content-Length exceeds the cap; stop reading one that grows past it."""

    def __init__(self, app: ASGIApp, *, max_bytes: int, sequencing: Sequencing | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.sequencing = sequencing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = header(scope, b"content-length")
        try:
            if declared is not None and declared.isdigit():
                if int(declared) > self.max_bytes:
                    raise PayloadTooLargeError(
                        f"request body is {int(declared)} bytes; the cap is {self.max_bytes} bytes per POST: "
                        "split the frame into request chunks"
                    )
                await self.app(scope, receive, send)  # the server enforces Content-Length framing
                return
            # No Content-Length (chunked upload): read up to the cap first, then hand the body on.
            body = await read_body(receive, self.max_bytes)
        except PayloadTooLargeError as refused:
            await _refuse(scope, receive, send, refused, self.sequencing, close=True)
            return
        if body is not None:
            await self.app(scope, replaying(body, receive), send)


class IdempotencyKeys:
    """Same ``Idempotency-Key``, route and caller → the first 2xx response again, never a second execution.

    Only 2xx answers are kept: a refused call executed nothing, so retrying it is safe. The key is
    bound to the body's SHA-256; reusing it with a different body is a 409. Records live in SQLite,
    so a replay after a service restart still answers from the record.

    Records are scoped by the caller :class:`RequireToken` let in (a hash of its token): another
    token using the same key gets a record of its own. Records expire after ``settings.idempotency_ttl_s``. A reply
    over ``settings.idempotency_max_response_bytes`` (a ``?wait=`` answer carrying a result) is
    kept as its bare ``{request_id, job_id}``, so a replay answers as the POST without ``?wait=``
    would and the caller polls for the result (the route names it in :data:`ACCEPTED_HEADER`, which
    this layer takes off every POST's answer of an API whose routes answer so: ``waited_answers``);
    any other reply that large is not kept, and a retry with its key executes again.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        db: store.Database,
        settings: ServeSettings,
        sequencing: Sequencing | None = None,
        waited_answers: bool = True,
    ) -> None:
        self.app = app
        self.db = db
        self.settings = settings
        self.sequencing = sequencing
        self._answered = _without_accepted if waited_answers else _as_it_is
        self._locks: weakref.WeakValueDictionary[tuple[str, str, str], asyncio.Lock] = weakref.WeakValueDictionary()
        self._next_purge = time.monotonic() + _PURGE_EVERY_S

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        raw_key = header(scope, _IDEMPOTENCY_HEADER)
        if raw_key is None:
            await self.app(scope, receive, self._answered(send))
            return
        key, route, caller = raw_key.decode("latin-1").strip(), f"POST {scope['path']}", scope.get(CALLER_SCOPE_KEY, "")
        if not key or len(key) > _MAX_KEY_LENGTH:
            refused = InvalidRequestError(f"Idempotency-Key must be 1-{_MAX_KEY_LENGTH} characters")
            await _refuse(scope, receive, send, refused, self.sequencing)
            return
        record = {"route": route, "caller": caller, "key": key}
        lock = self._locks.get((route, caller, key))
        if lock is None:
            lock = self._locks[(route, caller, key)] = asyncio.Lock()
        async with lock:
            body = await read_body(receive)
            if body is None:
                return
            digest = hashlib.sha256(body).hexdigest()
            saved = store.get_idempotent_response(self.db, **record, ttl_s=self.settings.idempotency_ttl_s)
            if saved is not None and saved["body_sha256"] != digest:
                message = "Idempotency-Key was already used on this route with a different body; use a new key"
                await _refuse(scope, receive, send, ConflictError(message), self.sequencing)
            elif saved is not None:
                replayed = {"idempotent-replayed": "true"}
                response = Response(bytes(saved["response"]), saved["status_code"], replayed, saved["media_type"])
                await response(scope, receive, send)
            else:
                await self._run_and_keep(scope, replaying(body, receive), send, record, digest)
        await self._purge_if_due()

    async def _run_and_keep(
        self, scope: Scope, receive: Receive, send: Send, record: dict[str, str], digest: str
    ) -> None:
        answer = Recorder(self._answered(send))
        await self.app(scope, receive, answer)
        if not 200 <= answer.status < 300:
            return
        headers = dict(answer.headers)
        response, media_type = answer.body, headers.get(b"content-type", b"application/json").decode()
        if len(response) > self.settings.idempotency_max_response_bytes:
            acceptance = headers.get(_ACCEPTED_KEY)
            if acceptance is None:
                _log.info(
                    "%s: reply too large to keep for its Idempotency-Key; a retry executes again", record["route"]
                )
                return
            response, media_type = acceptance, "application/json"  # what the route accepted
        kept = {"body_sha256": digest, "status_code": answer.status, "response": response, "media_type": media_type}
        # REPLACE: a record still in the table past its TTL must not block the new one
        self.db.insert("idempotency", {**record, **kept, "created_at": store.now_iso()}, verb="INSERT OR REPLACE")

    async def _purge_if_due(self) -> None:
        now = time.monotonic()
        if now < self._next_purge:
            return
        self._next_purge = now + min(_PURGE_EVERY_S, self.settings.idempotency_ttl_s)
        await asyncio.to_thread(store.purge_expired, self.db, idempotency_ttl_s=self.settings.idempotency_ttl_s)


def _without_accepted(send: Send) -> Send:
    """``send`` with :data:`ACCEPTED_HEADER` taken off the answer's headers: it is for this layer only."""

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = message.get("headers", ())
            if any(key == _ACCEPTED_KEY for key, _ in headers):
                message = {**message, "headers": [(k, v) for k, v in headers if k != _ACCEPTED_KEY]}
        await send(message)

    return sending


def _as_it_is(send: Send) -> Send:
    return send


def _text(raw: bytes | None) -> str | None:
    return None if raw is None else raw.decode("latin-1")


class JsonBodies:
    """400 for a JSON body nested too deeply or holding a non-finite number, before a route parses it;
    413 for one over :data:`MAX_JSON_BYTES`, before it is parsed at all.

    The routes' models cannot refuse either: ``1e400`` parses as infinity, and a body nested a few
    hundred levels deep breaks the framework's own encoders (a 500). See :func:`parse_json_body`.
    ``parse=False`` checks only the size and the count of containers and strings, for an API whose routes
    parse and check their bodies themselves (the Tinker API's: a refused op must still use up its ``seq_id``,
    which only the route can read).
    """

    def __init__(
        self, app: ASGIApp, *, parse: bool = True, sequencing: Sequencing | None = None, too_large: str = ""
    ) -> None:
        self.app = app
        self.parse = parse
        self.sequencing = sequencing
        self.too_large = too_large or "send a smaller body"  # what the API's caller can do instead

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS or not is_json(scope):
            await self.app(scope, receive, send)
            return
        try:
            body = await read_body(receive, MAX_JSON_BYTES)
        except PayloadTooLargeError:
            refused = PayloadTooLargeError(f"a JSON body is at most {MAX_JSON_BYTES} bytes here; {self.too_large}")
            await _refuse(scope, receive, send, refused, self.sequencing, close=True)
            return
        if body is None:
            return
        try:
            if len(body) > CHECK_ON_LOOP_BYTES:
                await asyncio.to_thread(self._check, body)
            elif body:
                self._check(body)
        except (InvalidRequestError, PayloadTooLargeError) as refused:
            await _refuse(scope, receive, send, refused, self.sequencing)
            return
        await self.app(scope, replaying(body, receive), send)

    def _check(self, body: bytes) -> None:
        if self.parse:
            parse_json_body(body)
        else:  # the routes parse it; what it could build is bounded here, for routes that parse with json alone
            check_counts(body, "the body", instead=self.too_large)


def is_json(scope: Scope) -> bool:
    """True for the media types the routes parse as JSON (``application/json``, ``application/*+json``)."""
    media_type = (header(scope, b"content-type") or b"").partition(b";")[0].strip().lower()
    return media_type == b"application/json" or (
        media_type.startswith(b"application/") and media_type.endswith(b"+json")
    )
