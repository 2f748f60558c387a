"""HTTP for the remote transport: URL prefix, auth headers, retries, error mapping, and the I/O loop.

:class:`Http` sends every request of a remote client from the client's own event loop straight to
an httpx transport (its connection pool): an httpx client on top would parse and merge URLs,
defaults and cookies on every request, which the API has no use for. Retries follow the training
API's schedule (0.5 s doubling plus jitter, capped at 10 s). Nothing above this module sees an httpx type.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import itertools
import json
import logging
import random
import ssl
import urllib.parse
from collections.abc import Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

import httpx
import orjson

from icefloe.client.loop import LoopThread
from icefloe.client.remote.errors import Redactor, error_from_response
from icefloe.config import RemoteConfig
from icefloe.protocol import (
    SEQUENCE_HEADER,
    ChunkGroupError,
    ConfigError,
    IcefloeError,
    IcefloeTimeoutError,
    RequestFailedError,
)
from icefloe.wire.batch import BATCH_MEDIA_TYPE, BATCH_PATH, pack, unpack

__all__ = ["Call", "Endpoint", "Http", "Reply", "Retry", "RetryPolicy", "TransportWrapper", "translate_errors"]

_log = logging.getLogger("icefloe.client.remote")

_TRANSIENT_STATUSES: Final = frozenset({429, 500, 502, 503, 504})
_RESTART_STATUSES: Final = frozenset({404, 409})  # the managed endpoint's front door answers these while restarting
_SERVICE_REQUEST_ID_HEADER: Final = "x-snowflake-request-id"
# Concurrent ops each hold a connection while their long poll waits; keep room for many.
_LIMITS: Final = httpx.Limits(max_connections=1024, max_keepalive_connections=128)

TransportWrapper = Callable[[httpx.AsyncBaseTransport], httpx.AsyncBaseTransport]  # a proxy layer, or test faults


class Retry(enum.Enum):
    """Which failures a call may be retried on."""

    TRANSIENT = "transient"  # connection errors, timeouts, 429, 5xx (404/409 on the managed endpoint)
    CONNECT_ONLY = "connect_only"  # only when the request provably never left (a non-idempotent create)
    NEVER = "never"


@dataclass(frozen=True, slots=True)
class Call:
    """One HTTP request relative to the API prefix, plus how to retry it."""

    method: str
    path: str  # "" = the prefix itself; "/{job_id}/step", ...
    what: str  # names the call in errors and logs, e.g. "forward-backward"
    json: Any = None
    content: bytes | None = None
    content_type: str = "application/octet-stream"  # of ``content``
    params: Mapping[str, Any] | None = None
    idempotency_key: str | None = None  # sent as Idempotency-Key; the same for every retry
    retry: Retry = Retry.TRANSIENT
    accept: frozenset[int] = frozenset()  # non-2xx statuses answered as a Reply instead of an error
    final: frozenset[int] = frozenset()  # statuses never retried for this call (e.g. 404 on delete)
    timeout_s: float | None = None  # None = the configured request timeout
    sequence: str | None = None  # sent as Icefloe-Sequence (the sequenced_submit extension)


@dataclass(frozen=True, slots=True)
class Reply:
    """A 2xx (or accepted) answer: its status and JSON body (None when empty)."""

    status_code: int
    body: Any = None


@dataclass(frozen=True)
class Endpoint:
    """Where the API lives and how to authenticate; ``headers`` hold the PAT, so never log them."""

    origin: str  # scheme://host[:port]
    prefix: str  # /api/v2/databases/{database}/schemas/{schema}/{endpoint}
    database: str
    schema: str
    endpoint: str
    pat: str | None
    verify_ssl: bool

    @classmethod
    def from_config(cls, backend: RemoteConfig) -> Endpoint:
        """Resolve ``base_url`` (no auth) or ``host`` + database/schema + PAT.

        Raises:
            ConfigError: neither base_url nor host is set, or host is set without a PAT.
        """
        database, schema = backend.database or "icefloe", backend.schema_ or "public"
        prefix = f"/api/v2/databases/{database}/schemas/{schema}/{backend.endpoint.strip('/')}"
        pat = backend.pat.get_secret_value() if backend.pat is not None else None
        if backend.base_url:
            origin = backend.base_url.rstrip("/")
            if not origin.startswith(("http://", "https://")):
                raise ConfigError(f"backend.base_url must start with http:// or https://; got {origin!r}")
        elif not backend.host:
            raise ConfigError(
                "backend.base_url or backend.host is required for backend.type='remote'; set base_url "
                "for `icefloe serve` (e.g. http://127.0.0.1:8321) or host + database + schema for the "
                "managed endpoint"
            )
        elif not pat:
            raise ConfigError(
                f"backend.pat is not set and the env var {backend.pat_env_var!r} was empty when the config "
                "was built; export it (or pass pat=...) and build the config with ClientConfig.from_env()"
            )
        else:
            origin = "https://" + backend.host.removeprefix("https://").rstrip("/")
        return cls(origin, prefix, database, schema, backend.endpoint, pat, backend.verify_ssl)

    @property
    def url(self) -> str:
        return self.origin + self.prefix

    def headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self.pat:
            headers["Authorization"] = f"Bearer {self.pat}"
            headers["X-Snowflake-Authorization-Token-Type"] = "PROGRAMMATIC_ACCESS_TOKEN"
        return headers

    def public(self) -> dict[str, str]:
        """The pieces a handle carries (never the PAT)."""
        return {name: getattr(self, name) for name in ("origin", "database", "schema", "endpoint")}


@functools.lru_cache(maxsize=2)
def _tls_context(verify: bool) -> ssl.SSLContext:
    """One per process and flag: loading the CA bundle takes ~50 ms."""
    return httpx.create_ssl_context(verify=verify)


class RetryPolicy:
    """Which failures a call may repeat, and how long to wait before it does."""

    def __init__(self, backend: RemoteConfig) -> None:
        self.max_retries = backend.max_retries
        self.initial_s = backend.retry_initial_s
        self.max_wait_s = backend.retry_max_s
        self.retry_restart_statuses = False  # set once the service is known to be the managed endpoint

    def should_retry(self, call: Call, exc: BaseException) -> bool:
        """True for a transient failure this call may repeat (chunk-group refusals never are)."""
        if call.retry is Retry.NEVER:
            return False
        if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
            # The request never left, so a retry is safe even for a create; but a refused connection means
            # nothing listens on the port, and waiting a minute of retries would only delay saying so.
            return not _refused(exc)
        if call.retry is Retry.CONNECT_ONLY:
            return False
        if isinstance(exc, httpx.TimeoutException | httpx.NetworkError | httpx.RemoteProtocolError):
            return True
        if isinstance(exc, ChunkGroupError) or not isinstance(exc, IcefloeError):
            return False
        status = exc.status_code
        if status is None or status in call.final:
            return False
        return status in _TRANSIENT_STATUSES or (self.retry_restart_statuses and status in _RESTART_STATUSES)

    def wait_s(self, attempt: int) -> float:
        """Seconds before retry ``attempt`` (1-based): initial·2^(n−1) + jitter, capped."""
        jitter = random.uniform(0.0, 2.0 * self.initial_s)
        return min(self.initial_s * 2 ** (attempt - 1) + jitter, self.max_wait_s)


def _refused(exc: BaseException | None) -> bool:
    """True when ``exc`` was caused by a refused TCP connection."""
    while exc is not None:
        if isinstance(exc, ConnectionRefusedError):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@contextlib.contextmanager
def translate_errors(call: Call, endpoint: Endpoint, redactor: Redactor, timeout_s: float) -> Iterator[None]:
    """Map httpx failures (after retries) to icefloe errors, most specific first, PAT scrubbed."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise IcefloeTimeoutError(
            redactor(f"{call.what}: {endpoint.origin} did not answer within {timeout_s:g} s ({type(exc).__name__})")
        ) from None
    except httpx.ConnectError as exc:
        raise RequestFailedError(
            redactor(f"{call.what}: cannot connect to {endpoint.origin}: {exc}; is the service running?"),
            category="server",
        ) from None
    except httpx.HTTPError as exc:
        raise RequestFailedError(
            redactor(f"{call.what}: HTTP exchange with {endpoint.origin} failed: {type(exc).__name__}: {exc}"),
            category="server",
        ) from None


def _json_or_text(response: httpx.Response) -> Any:
    """The body as JSON (orjson: a generate answer of 100 KiB parses in a third of the time), else text."""
    with contextlib.suppress(orjson.JSONDecodeError):
        return orjson.loads(response.content)
    try:  # NaN and Infinity, which the standard library writes and orjson refuses
        return json.loads(response.content)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return response.text[:2000]


def reply_of(call: Call, response: httpx.Response, redactor: Redactor) -> Reply:
    """A Reply for a 2xx or accepted status, else the typed error (raised)."""
    body = _json_or_text(response) if response.content else None
    if response.is_success or response.status_code in call.accept:
        return Reply(response.status_code, body)
    request_id = response.headers.get(_SERVICE_REQUEST_ID_HEADER)
    raise error_from_response(response.status_code, body, what=call.what, request_id=request_id, redactor=redactor)


def _wire(call: Call) -> tuple[dict[str, str], bytes]:
    """The call's own headers (the session's are added when it is sent) and its body."""
    headers, body = {}, b""
    if call.idempotency_key:
        headers["Idempotency-Key"] = call.idempotency_key
    if call.sequence:
        headers[SEQUENCE_HEADER] = call.sequence
    if call.content is not None:
        headers["Content-Type"], body = call.content_type, call.content
    elif call.json is not None:
        headers["Content-Type"], body = "application/json", json_body(call.json)
    return headers, body


def json_body(value: Any) -> bytes:
    """``value`` as httpx writes JSON, except that NaN and infinity are refused (ValueError), not sent."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def _query(call: Call) -> str:
    return urllib.parse.urlencode(call.params) if call.params else ""


_BACKGROUND: set[asyncio.Task[Any]] = set()


def _spawn(coroutine: Coroutine[Any, Any, None]) -> None:
    task = asyncio.get_running_loop().create_task(coroutine)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


class Http(LoopThread):
    """The client's I/O loop with its connection pool: ``send`` runs on the loop, ``run``/``start`` hand it work."""

    def __init__(self, endpoint: Endpoint, backend: RemoteConfig, wrap: TransportWrapper | None = None) -> None:
        self.endpoint, self.redactor = endpoint, Redactor(endpoint.pat)
        self.policy = RetryPolicy(backend)
        # > 0 once the service takes batches (the batch_requests extension): numbered POSTs that reach
        # ``send`` in one loop turn leave as one POST of at most this many bytes.
        self.batch_bytes = 0
        self._timeout_s = backend.request_timeout_s
        self._headers = endpoint.headers()
        # plain HTTP (`icefloe serve` on loopback) needs no TLS context
        tls = _tls_context(endpoint.verify_ssl) if endpoint.origin.startswith("https://") else False
        transport = httpx.AsyncHTTPTransport(verify=tls, limits=_LIMITS)
        self._transport = wrap(transport) if wrap else transport
        self._window: list[tuple[Call, asyncio.Future[httpx.Response]]] | None = None
        super().__init__("icefloe-remote-io", on_close=self._transport.aclose)

    async def send(self, call: Call) -> Reply:
        """One call, retried as the policy allows with the same ``Idempotency-Key``; a failure arrives as an
        icefloe error."""
        retries = self.policy.max_retries
        with translate_errors(call, self.endpoint, self.redactor, call.timeout_s or self._timeout_s):
            for attempt in itertools.count(1):
                try:
                    if self.batch_bytes and call.sequence and attempt == 1:
                        response = await self._in_window(call)
                    else:  # alone, and so is every retry
                        response = await self._exchange(call)
                    return reply_of(call, response, self.redactor)
                except Exception as exc:
                    if attempt > retries or not self.policy.should_retry(call, exc):
                        raise
                    _log.warning(
                        self.redactor(f"{call.what}: attempt {attempt}/{retries + 1} failed ({exc}); retrying")
                    )
                await asyncio.sleep(self.policy.wait_s(attempt))
        raise AssertionError("unreachable: the loop returns or raises")

    async def _exchange(self, call: Call) -> httpx.Response:
        """One request on the pool; the answer is read whole."""
        headers, body = _wire(call)
        query, timeout = _query(call), httpx.Timeout(call.timeout_s or self._timeout_s)
        url = self.endpoint.url + call.path + (f"?{query}" if query else "")
        headers = {**self._headers, **headers}
        request = httpx.Request(
            call.method, url, headers=headers, content=body, extensions={"timeout": timeout.as_dict()}
        )
        response = await self._transport.handle_async_request(request)
        try:
            await response.aread()
        finally:
            await response.aclose()
        return response

    def _in_window(self, call: Call) -> asyncio.Future[httpx.Response]:
        """Join the calls sent in this loop turn; they leave together when it ends."""
        loop = asyncio.get_running_loop()
        if self._window is None:
            self._window = []
            loop.call_soon(self._flush)
        answer: asyncio.Future[httpx.Response] = loop.create_future()
        self._window.append((call, answer))
        return answer

    def _flush(self) -> None:
        window, self._window = self._window or [], None
        batch: list[tuple[Call, asyncio.Future[httpx.Response]]] = []
        size = 0
        for waiting in window:
            body_size = len(waiting[0].content or b"") + 1024  # a JSON body and the part's header are small
            if batch and size + body_size > self.batch_bytes:
                _spawn(self._post_batch(batch))
                batch, size = [], 0
            batch.append(waiting)
            size += body_size
        if batch:
            _spawn(self._post_batch(batch))

    async def _post_batch(self, batch: list[tuple[Call, asyncio.Future[httpx.Response]]]) -> None:
        """One POST for the calls (a lone call goes as itself); each gets its own answer, or the failure."""
        try:
            if len(batch) == 1:
                answers = [await self._exchange(batch[0][0])]
            else:
                parts, bodies = [], []
                for call, _ in batch:
                    headers, body = _wire(call)
                    path = self.endpoint.prefix + call.path
                    parts.append(
                        {"method": call.method, "path": path, "query": _query(call), "headers": list(headers.items())}
                    )
                    bodies.append(body)
                timeout_s = max(call.timeout_s or self._timeout_s for call, _ in batch)
                content = pack(parts, bodies)
                response = await self._exchange(Call("POST", BATCH_PATH, "batch", content=content,
                                                     content_type=BATCH_MEDIA_TYPE, timeout_s=timeout_s))  # fmt: skip
                answers = [response] * len(batch)  # refused whole: each call reads the refusal
                if response.status_code == 200:
                    answers = [
                        httpx.Response(part["status"], headers=part["headers"], content=body)
                        for part, body in unpack(response.content)
                    ]
                    if len(answers) != len(batch):
                        raise RequestFailedError(
                            f"the service answered {len(answers)} parts to a batch of {len(batch)}"
                        )
        except Exception as exc:
            for _, answer in batch:
                if not answer.done():
                    answer.set_exception(exc)
            return
        for (_, answer), response in zip(batch, answers, strict=True):
            if not answer.done():
                answer.set_result(response)
