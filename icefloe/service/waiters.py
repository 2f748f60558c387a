"""Wake long-polls the moment a request finishes.

Requests finish on worker threads; pollers wait on the event loop. A poller registers a future
BEFORE re-reading the request's status, so a completion between the read and the wait is never
missed; the worker thread resolves every registered future through ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import defaultdict
from collections.abc import Callable

__all__ = ["RequestWaiters"]


class RequestWaiters:
    """Futures of pollers waiting on request ids, resolved from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]] = defaultdict(list)

    async def wait(self, request_id: str, *, timeout_s: float, finished: Callable[[], bool]) -> None:
        """Return when the request finishes or ``timeout_s`` passes, whichever is first."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        entry = (loop, future)
        with self._lock:
            self._waiting[request_id].append(entry)
        try:
            if not finished():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(future, timeout_s)
        finally:
            with self._lock:
                entries = self._waiting.get(request_id, [])
                if entry in entries:
                    entries.remove(entry)
                if not entries:
                    self._waiting.pop(request_id, None)

    def notify(self, request_id: str) -> None:
        with self._lock:
            entries = self._waiting.pop(request_id, [])
        for loop, future in entries:
            with contextlib.suppress(RuntimeError):  # the poller's loop already closed
                loop.call_soon_threadsafe(_resolve, future)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
