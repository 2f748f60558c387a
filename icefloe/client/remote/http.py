"""HTTP sessions of the remote transport: URL prefix, auth headers, retries and error mapping.

One :class:`SyncHttp` (``httpx.Client``) and one :class:`AsyncHttp` (an ``httpx.AsyncClient`` per
event loop; a loop change closes the old client) send :class:`~icefloe.client.remote.exchange.Call`
objects. Retries use tenacity with the training API's schedule (0.5 s doubling plus jitter, capped
at 10 s, ``1 + max_retries`` attempts). httpx errors are translated to icefloe errors in
:func:`translate_errors` only; nothing above this module sees an httpx type.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import random
import ssl
import threading
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final

import httpx
import orjson
import tenacity

from icefloe.client.remote.eager import EagerTransport
from icefloe.client.remote.errors import Redactor, error_from_response
from icefloe.client.remote.exchange import Call, Reply, Retry
from icefloe.config import RemoteConfig
from icefloe.protocol import ChunkGroupError, ConfigError, IcefloeTimeoutError, RequestFailedError

__all__ = ["AsyncHttp", "Endpoint", "RetryPolicy", "SyncHttp", "TransportWrapper", "translate_errors"]

_log = logging.getLogger("icefloe.client.remote")

_TRANSIENT_STATUSES: Final = frozenset({429, 500, 502, 503, 504})
_RESTART_STATUSES: Final = frozenset({404, 409})  # the managed endpoint's front door answers these while restarting
_SERVICE_REQUEST_ID_HEADER: Final = "x-snowflake-request-id"
_BODY_WRITTEN: Final = "http11.send_request_body.complete"  # the httpcore trace event of a request sent
_DEFAULT_DATABASE: Final = "icefloe"
_DEFAULT_SCHEMA: Final = "public"
# Concurrent ops each hold a connection while their long poll waits; keep room for many.
_LIMITS: Final = httpx.Limits(max_connections=1024, max_keepalive_connections=128)

TransportWrapper = Callable[[Any], Any]  # wraps an httpx (Async)HTTPTransport, e.g. to inject faults


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
    def from_config(cls, backend: RemoteConfig, environ: dict[str, str] | None = None) -> Endpoint:
        """Resolve ``base_url`` (no auth) or ``host`` + database/schema + PAT.

        Raises:
            ConfigError: neither base_url nor host is set, or host is set without a PAT.
        """
        database = backend.database or _DEFAULT_DATABASE
        schema = backend.schema_ or _DEFAULT_SCHEMA
        prefix = f"/api/v2/databases/{database}/schemas/{schema}/{backend.endpoint.strip('/')}"
        if backend.base_url:
            origin = backend.base_url.rstrip("/")
            if not origin.startswith(("http://", "https://")):
                raise ConfigError(f"backend.base_url must start with http:// or https://; got {origin!r}")
            pat = backend.pat.get_secret_value() if backend.pat is not None else None
            return cls(origin, prefix, database, schema, backend.endpoint, pat, backend.verify_ssl)
        if not backend.host:
            raise ConfigError(
                "backend.base_url or backend.host is required for backend.type='remote'; set base_url "
                "for `icefloe serve` (e.g. http://127.0.0.1:8321) or host + database + schema for the "
                "managed endpoint"
            )
        pat = backend.pat.get_secret_value() if backend.pat is not None else None
        if not pat:
            raise ConfigError(
                f"backend.pat is not set and the env var {backend.pat_env_var!r} was empty when the config "
                "was built; export it (or pass pat=...) and build the config with ClientConfig.from_env()"
            )
        host = backend.host.removeprefix("https://").rstrip("/")
        return cls(f"https://{host}", prefix, database, schema, backend.endpoint, pat, backend.verify_ssl)

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
        return {
            "origin": self.origin,
            "database": self.database,
            "schema": self.schema,
            "endpoint": self.endpoint,
        }


@functools.lru_cache(maxsize=2)
def _tls_context(verify: bool) -> ssl.SSLContext:
    """One TLS context per process and flag: loading the CA bundle takes ~50 ms, too long to repeat."""
    return httpx.create_ssl_context(verify=verify)


def _tls_for(endpoint: Endpoint) -> ssl.SSLContext | bool:
    """The context for an https origin; plain HTTP (``icefloe serve`` on loopback) needs none."""
    return _tls_context(endpoint.verify_ssl) if endpoint.origin.startswith("https://") else False


class RetryPolicy:
    """The retry predicate and wait schedule shared by both sessions."""

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
            return True  # the request never left: safe even for a create
        if call.retry is Retry.CONNECT_ONLY:
            return False
        if isinstance(exc, httpx.TimeoutException | httpx.NetworkError | httpx.RemoteProtocolError):
            return True
        if isinstance(exc, ChunkGroupError) or not isinstance(exc, RequestFailedError):
            return False
        status = exc.status_code
        if status is None or status in call.final:
            return False
        return status in _TRANSIENT_STATUSES or (self.retry_restart_statuses and status in _RESTART_STATUSES)

    def wait_s(self, attempt: int) -> float:
        """Seconds before retry ``attempt`` (1-based): initial·2^(n−1) + jitter, capped."""
        jitter = random.uniform(0.0, 2.0 * self.initial_s)
        return min(self.initial_s * 2 ** (attempt - 1) + jitter, self.max_wait_s)

    def _tenacity_kwargs(self, call: Call, redactor: Redactor) -> dict[str, Any]:
        def before_sleep(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            _log.warning(
                redactor(f"{call.what}: attempt {state.attempt_number}/{self.max_retries + 1} failed ({exc}); retrying")
            )

        return {
            "stop": tenacity.stop_after_attempt(self.max_retries + 1),
            "wait": lambda state: self.wait_s(state.attempt_number),
            "retry": tenacity.retry_if_exception(lambda exc: self.should_retry(call, exc)),
            "reraise": True,
            "before_sleep": before_sleep,
        }


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


def _sent_tracer(on_sent: Callable[[], None], is_async: bool) -> Callable[..., Any]:
    """An httpcore trace hook that calls ``on_sent`` once the request body is written."""

    def note(name: str) -> None:
        if name == _BODY_WRITTEN:
            on_sent()

    if not is_async:
        return lambda name, info: note(name)

    async def trace(name: str, info: Any) -> None:
        note(name)

    return trace


def _request_kwargs(call: Call, endpoint: Endpoint, timeout_s: float, *, is_async: bool) -> dict[str, Any]:
    headers = {}
    if call.idempotency_key:
        headers["Idempotency-Key"] = call.idempotency_key
    if call.sequence:
        headers["Icefloe-Sequence"] = call.sequence
    kwargs: dict[str, Any] = {"headers": headers, "timeout": timeout_s}
    if call.on_sent is not None:
        kwargs["extensions"] = {"trace": _sent_tracer(call.on_sent, is_async)}
    if call.params:
        kwargs["params"] = dict(call.params)
    if call.content is not None:
        headers["Content-Type"] = "application/octet-stream"
        kwargs["content"] = call.content
    elif call.json is not None:
        kwargs["json"] = call.json
    return kwargs


def _json_or_text(response: httpx.Response) -> Any:
    """The body as JSON (orjson: a generate answer of 100 KiB parses in a third of the time), else text."""
    try:
        return orjson.loads(response.content)
    except orjson.JSONDecodeError:
        pass
    try:  # NaN and Infinity, which the standard library writes and orjson refuses
        return json.loads(response.content)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return response.text[:2000]


def _reply(call: Call, response: httpx.Response, redactor: Redactor) -> Reply:
    """A Reply for a 2xx or accepted status, else the typed error (raised)."""
    service_request_id = response.headers.get(_SERVICE_REQUEST_ID_HEADER)
    body: Any = None
    if response.content:
        body = _json_or_text(response)
    if response.is_success or response.status_code in call.accept:
        return Reply(response.status_code, body, service_request_id)
    if service_request_id:
        _log.info(
            "%s answered HTTP %s (x-snowflake-request-id %s)",
            call.what,
            response.status_code,
            service_request_id,
        )
    raise error_from_response(
        response.status_code, body, what=call.what, request_id=service_request_id, redactor=redactor
    )


class SyncHttp:
    """Blocking session over one ``httpx.Client`` (thread-safe, pooled)."""

    def __init__(
        self,
        endpoint: Endpoint,
        backend: RemoteConfig,
        policy: RetryPolicy,
        redactor: Redactor,
        wrap: TransportWrapper | None = None,
    ) -> None:
        self._endpoint, self._policy, self._redactor, self._wrap = endpoint, policy, redactor, wrap
        self._timeout_s = backend.request_timeout_s
        self._lock = threading.Lock()
        self._client: httpx.Client | None = None

    def _transport(self) -> httpx.BaseTransport:
        transport = httpx.HTTPTransport(verify=_tls_for(self._endpoint), limits=_LIMITS)
        return self._wrap(transport) if self._wrap else transport

    def _get(self) -> httpx.Client:
        with self._lock:
            if self._client is None:
                self._client = httpx.Client(
                    base_url=self._endpoint.url,
                    headers=self._endpoint.headers(),
                    transport=self._transport(),
                )
            return self._client

    def send(self, call: Call) -> Reply:
        timeout_s = call.timeout_s or self._timeout_s
        client = self._get()
        kwargs = _request_kwargs(call, self._endpoint, timeout_s, is_async=False)
        with translate_errors(call, self._endpoint, self._redactor, timeout_s):
            for attempt in tenacity.Retrying(**self._policy._tenacity_kwargs(call, self._redactor)):
                with attempt:
                    return _reply(call, client.request(call.method, call.path, **kwargs), self._redactor)
        raise AssertionError("unreachable: tenacity re-raises the last failure")

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()


class AsyncHttp:
    """Awaiting session: one ``httpx.AsyncClient`` per event loop; a new loop closes the old client.

    Each client is tied to its loop by a small async generator whose ``finally`` closes it. The
    loop finalises open async generators when it shuts down (``asyncio.run`` does), so a client
    whose loop ends without ``aclose()`` still closes its sockets on that loop, where it must.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        backend: RemoteConfig,
        policy: RetryPolicy,
        redactor: Redactor,
        wrap: TransportWrapper | None = None,
    ) -> None:
        self._endpoint, self._policy, self._redactor, self._wrap = endpoint, policy, redactor, wrap
        self._timeout_s = backend.request_timeout_s
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closer: AsyncGenerator[None, None] | None = None

    def _transport(self, tls: ssl.SSLContext | bool) -> httpx.AsyncBaseTransport:
        transport: httpx.AsyncBaseTransport
        if self._endpoint.origin.startswith("http://"):  # icefloe serve: no TLS, latency is all that counts
            transport = EagerTransport(max_connections=_LIMITS.max_connections or 1024)
        else:
            transport = httpx.AsyncHTTPTransport(verify=tls, limits=_LIMITS)
        return self._wrap(transport) if self._wrap else transport

    async def _get(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._client is not None and (self._loop is not loop or self._client.is_closed):
            await self.aclose()
        if self._client is None:
            tls = await asyncio.to_thread(_tls_for, self._endpoint)  # file I/O once; never on the loop
            if self._client is not None and self._loop is loop:
                return self._client  # a concurrent first call built it while this one awaited
            client = httpx.AsyncClient(
                base_url=self._endpoint.url, headers=self._endpoint.headers(), transport=self._transport(tls)
            )
            closer = _close_with_loop(client)
            await anext(closer)  # registers the generator with this loop's shutdown_asyncgens()
            self._client, self._loop, self._closer = client, loop, closer
        return self._client

    async def send(self, call: Call) -> Reply:
        timeout_s = call.timeout_s or self._timeout_s
        client = await self._get()
        kwargs = _request_kwargs(call, self._endpoint, timeout_s, is_async=True)
        with translate_errors(call, self._endpoint, self._redactor, timeout_s):
            async for attempt in tenacity.AsyncRetrying(**self._policy._tenacity_kwargs(call, self._redactor)):
                with attempt:
                    try:
                        response = await client.request(call.method, call.path, **kwargs)
                        return _reply(call, response, self._redactor)
                    except Exception:  # no answer, or one the service keeps the POST's place for a retry
                        if call.on_lost is not None:
                            call.on_lost()
                        raise
        raise AssertionError("unreachable: tenacity re-raises the last failure")

    def _take(self) -> tuple[asyncio.AbstractEventLoop | None, AsyncGenerator[None, None] | None]:
        loop, closer = self._loop, self._closer
        self._client, self._loop, self._closer = None, None, None
        return loop, closer

    async def aclose(self) -> None:
        """Close the current client on its own loop (this one, or another thread's running loop)."""
        loop, closer = self._take()
        if closer is None:
            return
        if loop is asyncio.get_running_loop():
            await closer.aclose()
        elif loop is not None and loop.is_running():
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(closer.aclose(), loop))
        # else: its loop has ended, and shutting down closed the client already

    def close_sync(self) -> None:
        """Close from blocking code; the client's loop must still run elsewhere or have ended."""
        loop, closer = self._take()
        if closer is None or loop is None or loop.is_closed():
            return
        if loop.is_running():
            if _running_loop() is loop:
                loop.create_task(closer.aclose())  # blocking close() called inside the loop itself
            else:
                asyncio.run_coroutine_threadsafe(closer.aclose(), loop).result(timeout=30)
        else:
            loop.run_until_complete(closer.aclose())


async def _close_with_loop(client: httpx.AsyncClient) -> AsyncGenerator[None, None]:
    try:
        yield
    finally:
        await client.aclose()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
