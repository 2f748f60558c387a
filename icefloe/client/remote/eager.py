"""An httpx transport that puts each request on the wire in the call that sends it.

httpcore's async transport reaches the socket through a dozen awaits (pool lock, connection lock,
anyio checkpoints), and each lets the event loop run one step of every other task first. A
training loop that submits an op and then builds the next minibatch on the same loop delays its
own request by a minibatch per await: the first ``fwd_bwd`` of a step left 2 ms after it was sent.
Here the request bytes go to the socket synchronously (``transport.write``) when an idle
connection is at hand, and the response is parsed by the protocol's ``data_received`` as it
arrives, so sending costs no loop turn at all and receiving costs one.

HTTP/1.1 framing is h11's (as in httpcore); one request per connection at a time, idle
connections reused most recent first. Used for plain ``http://`` origins (``icefloe serve``); TLS
and proxies stay with httpcore. A connection the server closed while idle is never reused; a
request whose connection closes before its answer raises ``httpx.RemoteProtocolError``, which
the retry policy treats as transient, exactly as with httpcore.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
from collections import deque
from typing import Final

import h11
import httpx

__all__ = ["EagerTransport"]

_BODY_WRITTEN: Final = "http11.send_request_body.complete"  # the trace event httpcore emits at the same point
_CLOSE_WAIT_S: Final = 1.0  # aclose waits this long for sockets to report closed
_JOIN_BELOW: Final = 64 * 1024  # a smaller body goes out with its head in one write (one syscall)


class _Unsent(Exception):
    """The connection was closed before the request was written: it may go on another one."""


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: writes a request, collects its response, then is reusable or closed."""

    def __init__(self, origin: tuple[str, int]) -> None:
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self._h11 = h11.Connection(h11.CLIENT)
        self._response: h11.Response | None = None
        self._body: list[bytes] = []
        self._answer: asyncio.Future[tuple[h11.Response, bytes]] | None = None
        self.closed = False
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    # --- asyncio.Protocol -------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self._h11.receive_data(data)
            self._pump()
        except h11.RemoteProtocolError as exc:
            self._fail(httpx.RemoteProtocolError(f"malformed HTTP response: {exc}"))

    def eof_received(self) -> bool:
        with contextlib.suppress(h11.RemoteProtocolError):
            self._h11.receive_data(b"")
            self._pump()
        self._fail(httpx.RemoteProtocolError("Server disconnected without sending a complete response."))
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(httpx.ReadError(f"connection lost: {exc}") if exc else None)
        if not self.lost.done():
            self.lost.set_result(None)

    # --- requests -----------------------------------------------------------------------------------
    @property
    def reusable(self) -> bool:
        """Open and between exchanges; a closed connection waiting in the socket is caught by :meth:`stale`."""
        return (
            not self.closed
            and self.transport is not None
            and not self.transport.is_closing()
            and self._h11.our_state is h11.IDLE
            and self._h11.their_state is h11.IDLE
        )

    def stale(self) -> bool:
        """True when an idle connection's socket is readable: the server closed it (keep-alive timeout)
        while this loop was busy and has not yet seen the EOF. One non-blocking poll, as httpcore does."""
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        if sock is None:
            return True
        if not hasattr(select, "poll"):  # Windows: select, which there takes any socket
            return bool(select.select([sock.fileno()], [], [], 0)[0])
        poller = select.poll()  # not select.select: it refuses descriptors above 1023
        poller.register(sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))

    def write(self, request: httpx.Request, body: bytes) -> None:
        """Queue the whole request on the socket now; the answer is awaited with :meth:`response`.

        Raises:
            _Unsent: the connection closed before any byte of the request was written.
        """
        if self.closed or self.transport is None or self.transport.is_closing():
            raise _Unsent
        head = h11.Request(method=request.method, target=request.url.raw_path, headers=list(request.headers.raw))
        try:
            parts = [self._h11.send(head) or b""]
        except h11.LocalProtocolError:  # the server's close reached h11 first: nothing was written
            raise _Unsent from None
        if body:
            parts.extend(self._h11.send_with_data_passthrough(h11.Data(data=body)) or ())
        parts.append(self._h11.send(h11.EndOfMessage()) or b"")
        self._answer = asyncio.get_running_loop().create_future()
        if len(body) < _JOIN_BELOW:
            self.transport.write(b"".join(parts))
        else:  # no copy of a large body: the socket takes what it can, the transport buffers the rest
            for part in parts:
                self.transport.write(part)

    async def response(self, timeout_s: float | None) -> tuple[h11.Response, bytes]:
        """The answer to the request written last; TimeoutError after ``timeout_s`` (None: no limit)."""
        assert self._answer is not None
        try:
            async with asyncio.timeout(timeout_s):
                return await self._answer
        finally:
            self._answer = None

    def finish_cycle(self) -> None:
        """After a complete exchange: ready for the next request, or closed when either side said so."""
        if self._h11.our_state is h11.DONE and self._h11.their_state is h11.DONE:
            self._h11.start_next_cycle()
            self._response, self._body = None, []
        else:
            self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _pump(self) -> None:
        while True:
            event = self._h11.next_event()
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.Response):
                self._response = event
            elif isinstance(event, h11.Data):
                self._body.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                if self._answer is not None and not self._answer.done() and self._response is not None:
                    self._answer.set_result((self._response, b"".join(self._body)))
                return
            elif isinstance(event, h11.ConnectionClosed):
                self._fail(httpx.RemoteProtocolError("Server disconnected without sending a response."))
                return
            # h11.InformationalResponse (1xx): the final response follows

    def _fail(self, error: Exception | None) -> None:
        self.closed = True
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(error or httpx.RemoteProtocolError("connection closed mid-response"))


class EagerTransport(httpx.AsyncBaseTransport):
    """Plain-HTTP/1.1 transport for ``httpx.AsyncClient``; at most ``max_connections`` sockets at once."""

    def __init__(self, *, max_connections: int = 1024, max_idle: int = 128) -> None:
        self._max_idle = max_idle
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: deque[_Connection] = deque()
        self._open: set[_Connection] = set()
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.scheme != "http":
            raise httpx.UnsupportedProtocol(f"EagerTransport speaks plain http only; got {request.url.scheme!r}")
        if self._closed:
            raise RuntimeError("the transport was closed; build a new client")
        timeouts = request.extensions.get("timeout") or {}
        try:
            body = request.content
        except httpx.RequestNotRead:
            body = await request.aread()
        origin = (request.url.host, request.url.port or 80)
        await self._slots.acquire()  # returns without yielding while a slot is free
        try:
            connection = await self._written(request, body, origin, timeouts.get("connect"))
            try:
                trace = request.extensions.get("trace")
                if trace is not None:
                    await trace(_BODY_WRITTEN, {"request": request})
                try:
                    head, content = await connection.response(timeouts.get("read"))
                except TimeoutError:
                    raise httpx.ReadTimeout(f"no answer within {timeouts.get('read')} s", request=request) from None
            except BaseException:
                self._forget(connection)  # a half-done exchange leaves the connection unusable
                raise
            connection.finish_cycle()
            self._keep(connection)
        finally:
            self._slots.release()
        return httpx.Response(
            head.status_code,
            headers=head.headers.raw_items(),
            stream=httpx.ByteStream(content),
            extensions={"http_version": b"HTTP/" + head.http_version, "reason_phrase": head.reason},
        )

    async def _written(
        self, request: httpx.Request, body: bytes, origin: tuple[str, int], connect_timeout_s: float | None
    ) -> _Connection:
        """The connection ``request`` was written to: an idle one, else a new one (twice, if the server
        closes the first before the request went out)."""
        connection = self._reuse(origin)
        for _ in range(3):
            if connection is None:
                connection = await self._connect(origin, connect_timeout_s)
            try:
                connection.write(request, body)
                return connection
            except _Unsent:
                self._forget(connection)
                connection = None
            except BaseException:
                self._forget(connection)
                raise
        raise httpx.ConnectError(f"{origin[0]}:{origin[1]} closed each new connection before a request could be sent")

    def _reuse(self, origin: tuple[str, int]) -> _Connection | None:
        for _ in range(len(self._idle)):
            connection = self._idle.pop()
            if connection.origin == origin and connection.reusable and not connection.stale():
                return connection
            if connection.origin != origin and connection.reusable:
                self._idle.appendleft(connection)  # another origin's: keep it
            else:
                self._forget(connection)
        return None

    async def _connect(self, origin: tuple[str, int], timeout_s: float | None) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(origin), *origin), timeout_s
            )
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {origin[0]}:{origin[1]} took over {timeout_s} s") from None
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {origin[0]}:{origin[1]}: {exc}") from None
        self._open.add(connection)
        return connection

    def _keep(self, connection: _Connection) -> None:
        if connection.reusable and not self._closed and len(self._idle) < self._max_idle:
            self._idle.append(connection)
        else:
            self._forget(connection)

    def _forget(self, connection: _Connection) -> None:
        connection.close()
        self._open.discard(connection)

    async def aclose(self) -> None:
        self._closed = True
        connections, self._open = list(self._open), set()
        self._idle.clear()
        for connection in connections:
            connection.close()
        waiting = [c.lost for c in connections if c.transport is not None]
        if waiting:  # let each socket report closed on this loop, so none is left for the collector
            await asyncio.wait(waiting, timeout=_CLOSE_WAIT_S)

    def __repr__(self) -> str:
        return f"EagerTransport(open={len(self._open)}, idle={len(self._idle)})"
