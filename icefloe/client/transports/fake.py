"""``FakeTransport``: a transport that answers with a function, for tests of faults above the seam that
no real backend makes on demand (an open that fails once); the rest runs on the local transport.

Like httpx's ``MockTransport``: hand it ``handler(request)`` (a function or a coroutine function)
and every op's answer is what the handler returns, its error what the handler raises. Coroutine
handlers run on one background event loop (as remote I/O does), so concurrent ops overlap there.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from icefloe.client.loop import LoopThread
from icefloe.client.transports.base import Transport
from icefloe.protocol import OPS, ClientClosedError, Request

__all__ = ["FakeTransport"]


class FakeTransport(Transport):
    """Answers each request with ``handler(request)``; ``requests`` lists what it was handed, in call order."""

    def __init__(self, handler: Callable[[Request], Any], *, capabilities: frozenset[str] = OPS) -> None:
        self.handler = handler
        self.capabilities = frozenset(capabilities)
        self.requests: list[Request] = []
        self.opened = self.closed = False
        self._io = LoopThread("icefloe-fake-io")
        self._lock = threading.Lock()

    def open(self) -> None:
        if self.closed:
            raise ClientClosedError("this fake transport was closed")
        self.opened = True

    def handle(self, request: Request) -> Future:
        if self.closed:
            raise ClientClosedError(f"cannot run {request.op!r}: the transport was closed")
        with self._lock:
            self.requests.append(request)
        if asyncio.iscoroutinefunction(self.handler):
            return self._io.submit(self.handler(request))
        future: Future = Future()
        try:
            future.set_result(self.handler(request))
        except Exception as exc:
            future.set_exception(exc)
        return future

    def close(self) -> None:
        self.closed = True
        self._io.close()

    def handle_info(self) -> dict[str, Any]:
        return {"backend": "fake"}
