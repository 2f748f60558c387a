"""Generate calls issued in the same event-loop turn travel as one HTTP request.

Frameworks fire one ``generate`` per prompt from many coroutines at once; sent one by one, each
pays its own POST and poll and the service sees a trickle. Calls that arrive before the loop's
next turn are merged (per-prompt sampling params keep each caller's settings), sent once, and each
caller gets its own slice of the prompt-major results. No timer: a lone call leaves at once.
If the merged call is refused as the caller's fault, each call is retried alone, so one bad prompt
fails only its own caller.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from icefloe.client.remote.ordering import Turn
from icefloe.protocol import OP_GENERATE, InvalidRequestError, Request, RequestFailedError, SamplingParams

__all__ = ["GenerateCoalescer", "PerLoopBatches", "deliver"]

Send = Callable[[Request, Turn], Awaitable[dict[str, Any]]]
B = TypeVar("B")


def _params_per_prompt(request: Request) -> list[SamplingParams]:
    params = request.body["sampling_params"]
    return list(params) if isinstance(params, list) else [params] * len(request.body["prompts"])


@dataclass
class _Batch:
    turn: Turn  # reserved when the first call arrived, so the batch keeps that call's place in line
    items: list[tuple[Request, asyncio.Future]] = field(default_factory=list)


class PerLoopBatches(Generic[B]):
    """What both coalescers keep: the open batch of each event loop, and the sends in flight."""

    def __init__(self) -> None:
        self._open: dict[asyncio.AbstractEventLoop, B] = {}
        self._flushes: set[asyncio.Task] = set()

    def _track(self, task: asyncio.Task) -> None:
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def cancel(self) -> None:
        """Stop the sends still in flight (the client is closing); their callers get CancelledError."""
        loop = asyncio.get_running_loop()  # another loop's tasks are that loop's to end
        flushes = [task for task in self._flushes if not task.done() and task.get_loop() is loop]
        for task in flushes:
            task.cancel()
        if flushes:
            await asyncio.wait(flushes)

    def seal(self) -> None:
        """Close this loop's open batch: a call made later must not join one that goes before it."""
        with contextlib.suppress(RuntimeError):  # no running loop: nothing can be open
            self._open.pop(asyncio.get_running_loop(), None)


class GenerateCoalescer(PerLoopBatches[_Batch]):
    """Merges concurrent generate requests of one event loop.

    ``send(request, turn)`` delivers one request in its turn; ``take_turn()`` reserves a sampling turn.
    """

    def __init__(self, send: Send, take_turn: Callable[[], Turn]) -> None:
        super().__init__()
        self._send = send
        self._take_turn = take_turn

    async def submit(self, request: Request) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        batch = self._open.get(loop)
        if batch is None:
            batch = self._open[loop] = _Batch(self._take_turn())
            loop.call_soon(self._start_flush, loop, batch)  # after every call already queued this turn
        batch.items.append((request, future))
        return await future

    def _start_flush(self, loop: asyncio.AbstractEventLoop, batch: _Batch) -> None:
        if self._open.get(loop) is batch:
            del self._open[loop]
        self._track(loop.create_task(self._flush(batch)))

    async def _flush(self, batch: _Batch) -> None:
        live = [(request, future) for request, future in batch.items if not future.done()]
        if len(live) <= 1:
            if live:
                await deliver(self._send(live[0][0], batch.turn), live[0][1])
            batch.turn.release()
            return
        params_by_call = [_params_per_prompt(request) for request, _ in live]
        merged = Request(
            OP_GENERATE,
            live[0][0].target,
            {
                "prompts": [prompt for request, _ in live for prompt in request.body["prompts"]],
                "sampling_params": [p for params in params_by_call for p in params],
            },
        )
        try:
            result = await self._send(merged, batch.turn)
        except (InvalidRequestError, RequestFailedError) as exc:
            if isinstance(exc, RequestFailedError) and exc.category != "user":
                _fail_all(live, exc)
                return
            await asyncio.gather(*(deliver(self._send(r, self._take_turn()), f) for r, f in live))
            return
        except BaseException as exc:
            _fail_all(live, exc)
            if not isinstance(exc, Exception):
                raise
            return
        samples = list(result.get("results", []))
        start = 0
        for (_, future), params in zip(live, params_by_call, strict=True):
            count = sum(p.n for p in params)
            if not future.done():
                future.set_result({**result, "results": samples[start : start + count]})
            start += count


async def deliver(sending: Awaitable[Any], future: asyncio.Future) -> None:
    """Settle ``future`` with what ``sending`` returns or raises."""
    try:
        result = await sending
    except BaseException as exc:
        if not future.done():
            future.set_exception(exc)
        if not isinstance(exc, Exception):
            raise
    else:
        if not future.done():
            future.set_result(result)


def _fail_all(items: list[tuple[Request, asyncio.Future]], exc: BaseException) -> None:
    for _, future in items:
        if not future.done():
            future.set_exception(exc)
