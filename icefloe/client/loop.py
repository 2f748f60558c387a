"""The client's own event loop: one asyncio loop on a daemon thread, started on first use.

Remote I/O runs here, never on the caller's loop: ``Client`` blocks on a ``concurrent.futures.Future``
and ``AsyncClient`` awaits one, so user code that builds the next minibatch between awaits never
delays a request already handed over. ``close`` cancels what still runs, then stops and joins the
thread; a closed ``LoopThread`` refuses new work.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

from icefloe.protocol import ClientClosedError

__all__ = ["LoopThread"]

T = TypeVar("T")


class LoopThread:
    """An asyncio loop running on its own daemon thread; ``on_close`` runs on it last (close clients there)."""

    def __init__(self, name: str, on_close: Callable[[], Awaitable[None]] | None = None) -> None:
        self._name = name
        self._on_close = on_close
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop (started now if it was not)."""
        with self._lock:
            if self._closed:
                raise ClientClosedError("the client was shut down; build a new client")
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name=self._name, daemon=True)
                self._thread.start()
            return self._loop

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> Future[T]:
        """Schedule ``coroutine`` on the loop; cancelling the returned future cancels it."""
        try:
            loop = self.loop
        except ClientClosedError:
            coroutine.close()
            raise
        return asyncio.run_coroutine_threadsafe(coroutine, loop)

    def start(self, coroutine: Coroutine[Any, Any, T]) -> Future[T]:
        """Run ``coroutine`` to its end on the loop; cancelling the returned future only stops the waiting.

        For work that must finish once begun (a numbered submission). If ``close`` cancels it,
        the future raises ``ClientClosedError``.
        """
        future: Future[T] = Future()

        async def run() -> None:
            try:
                result = await coroutine
            except asyncio.CancelledError:
                _settle(future, error=ClientClosedError("the client was shut down before this op finished"))
                raise
            except Exception as exc:
                _settle(future, error=exc)
            else:
                _settle(future, result=result)

        self.submit(run())
        return future

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the loop and block until it ends (never call this from the loop itself)."""
        return self.submit(coroutine).result()

    def close(self) -> None:
        """Cancel the tasks still running, run ``on_close``, stop and join the thread. Idempotent."""
        with self._lock:
            self._closed = True
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None or thread is None:
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()

    async def _shutdown(self) -> None:
        current = asyncio.current_task()
        others = [task for task in asyncio.all_tasks() if task is not current]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        if self._on_close is not None:
            await self._on_close()
        loop = asyncio.get_running_loop()
        await loop.shutdown_asyncgens()
        await loop.shutdown_default_executor()


def _settle(future: Future, *, result: Any = None, error: BaseException | None = None) -> None:
    if future.set_running_or_notify_cancel():  # False: the caller cancelled it and waits no more
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
