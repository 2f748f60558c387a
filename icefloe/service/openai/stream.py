"""Answers that watch their caller: a request whose client goes away has its sampling stopped.

:class:`EventStream` sends server-sent events (``data: {json}``, then ``data: [DONE]``) made from
the request's progress (:func:`icefloe.service.openai.sampling.progress`), each event holding what
is new since the last; :func:`until_done` is the same wait for an answer sent whole. Both race the
wait against the client's disconnect, and on a disconnect cancel the sampling at its next decode step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from icefloe.protocol import ClientClosedError, IcefloeError
from icefloe.service.errors import status_and_body
from icefloe.service.openai.errors import error_body

__all__ = ["EventStream", "until_done"]

T = TypeVar("T")


async def _gone(receive: Receive) -> None:
    """Returns once the client disconnected (the request's body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_done(receive: Receive, waiting: Awaitable[T], on_gone: Callable[[], None]) -> T:
    """``waiting``'s result; if the client disconnects first, ``on_gone()`` and :class:`ClientClosedError`."""
    task = asyncio.ensure_future(waiting)
    watcher = asyncio.ensure_future(_gone(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        on_gone()
        raise ClientClosedError("the client went away before its answer was ready")
    finally:
        for pending in (task, watcher):
            pending.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.gather(task, watcher, return_exceptions=True)


class EventStream(Response):
    """The JSON events of ``events`` as server-sent events; a failure after the first event is one
    last ``{"error": ...}`` event, as OpenAI sends it."""

    def __init__(
        self, events: AsyncIterator[dict[str, Any]], on_gone: Callable[[], None], public_text: Callable[[str], str]
    ) -> None:
        super().__init__(status_code=200, media_type="text/event-stream")
        self.events = events
        self.on_gone = on_gone
        self.public_text = public_text

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        try:
            while True:
                try:
                    event = await until_done(receive, anext(self.events), self.on_gone)
                except StopAsyncIteration:
                    break
                await _send(send, json.dumps(event, separators=(",", ":")))
            await _send(send, "[DONE]")
        except ClientClosedError:
            return
        except IcefloeError as exc:
            status, body = status_and_body(exc)
            await _send(send, json.dumps(error_body(status, self.public_text(body["message"]))))
        finally:
            with contextlib.suppress(Exception):
                await self.events.aclose()  # type: ignore[attr-defined]
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _send(send: Send, data: str) -> None:
    await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(), "more_body": True})
