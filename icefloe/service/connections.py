"""The HTTP/1.1 protocol the service's uvicorn runs: uvicorn's h11 protocol with read deadlines.

uvicorn times out only an idle keep-alive connection: a connection that trickles its request
headers, or stops in the middle of a body, is held open for ever, and a few hundred of them hold as
many sockets and file descriptors (slowloris). Here a request's headers must arrive within
``header_timeout_s`` of the connection opening (or of the previous response), and its body within
``body_timeout_s`` plus one second per :data:`BODY_BYTES_PER_S` bytes it delivers, so a slow but
steady upload keeps going. Past its deadline the connection is closed, after a 408 when part of a
request came and no answer has begun (an idle connection is just closed, as keep-alive does).
Time when the service, not the peer, holds the body up (the app has not read what came) does not
count.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from icefloe.protocol import CODE_REQUEST_TIMEOUT

__all__ = ["BODY_BYTES_PER_S", "deadline_protocol"]

BODY_BYTES_PER_S = 8192  # each this many body bytes delivered earn the body one more second


def deadline_protocol(*, header_timeout_s: float, body_timeout_s: float) -> type[asyncio.Protocol]:
    """The protocol class to give ``uvicorn.Config(http=...)``."""
    attributes = {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s}
    return type("DeadlineH11Protocol", (_DeadlineH11Protocol,), attributes)


class _DeadlineH11Protocol(H11Protocol):
    header_timeout_s: float
    body_timeout_s: float

    def connection_made(self, transport: Any) -> None:
        self._phase: str | None = None  # "headers" or "body": what the peer owes now; None: nothing
        self._phase_began = 0.0
        self._phase_bytes = 0  # what the peer sent of it so far
        self._timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._watch()

    def data_received(self, data: bytes) -> None:
        self._phase_bytes += len(data)
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        super().connection_lost(exc)

    def _watch(self) -> None:
        """Start the deadline of what the peer owes now, when that changed (a deadline runs on until then)."""
        state = self.conn.their_state
        phase = "headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
        if phase == self._phase or self.transport.is_closing():
            return
        self._cancel()
        self._phase, self._phase_began, self._phase_bytes = phase, self.loop.time(), 0
        if phase is not None:
            self._timer = self.loop.call_later(self._allowed_s(), self._expire)

    def _allowed_s(self) -> float:
        if self._phase == "headers":
            return self.header_timeout_s
        return self.body_timeout_s + self._phase_bytes / BODY_BYTES_PER_S

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self.transport.is_closing() or self._phase is None:
            return
        if self._phase == "body" and (self.flow.read_paused or self.cycle.waiting_for_100_continue):
            self._phase_began, self._phase_bytes = self.loop.time(), 0  # the app has not read yet: not the peer's delay
        left = self._phase_began + self._allowed_s() - self.loop.time()
        if left > 0:
            self._timer = self.loop.call_later(left, self._expire)
            return
        cycle = self.cycle if self._phase == "body" else None
        if (cycle is None and self._phase_bytes) or (cycle is not None and not cycle.response_started):
            if self._phase == "headers":
                late = f"the request headers did not arrive within {self.header_timeout_s:g} s"
            else:
                late = f"the request body did not arrive within {self.body_timeout_s:g} s"
                late += f" (+1 s per {BODY_BYTES_PER_S} bytes it delivered)"
            self.transport.write(_timeout_response(f"{late}; the connection is closed"))
        if cycle is not None:  # the app reading the body sees the client gone; its answer goes nowhere
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()


def _timeout_response(message: str) -> bytes:
    body = json.dumps({"code": CODE_REQUEST_TIMEOUT, "message": message}).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body
