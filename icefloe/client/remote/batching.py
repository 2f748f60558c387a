"""Training ops called in the same event-loop turn travel as one POST (the ``batch_submit`` extension).

A training loop submits each minibatch's ``fwd_bwd`` and ``step`` back to back. Sent apart, each
pays a whole HTTP exchange on both ends, and on a small machine the service's share of that
competes with the engines for the CPU. Like generate calls (:mod:`.coalesce`), the first op of a
loop turn reserves one place in line for the whole batch, and the batch leaves on the loop's next
turn with every op queued behind it; a lone op goes exactly as it would alone. Each caller gets
its own op's result or error: an op that fails on the service fails only its caller, while a POST
the service refuses outright (it validates every op before queuing any) fails them all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from icefloe.client.remote.coalesce import PerLoopBatches, deliver
from icefloe.client.remote.ordering import Turn
from icefloe.protocol import Request

__all__ = ["OpBatcher", "Outcome"]

Outcome = tuple[bool, Any]  # (True, result) or (False, the exception this op's caller gets)
SendOne = Callable[[Request, Turn], Awaitable[Any]]
SendMany = Callable[[list[Request], Turn], Awaitable[list[Outcome]]]


@dataclass
class _Batch:
    turn: Turn  # reserved when the first op arrived: the batch keeps that op's place in line
    items: list[tuple[Request, asyncio.Future]] = field(default_factory=list)
    size: int = 0  # payload bytes so far


class OpBatcher(PerLoopBatches[_Batch]):
    """Gathers the batchable ops of one event-loop turn; at most ``max_ops`` ops and ``max_bytes`` per POST."""

    def __init__(
        self, send_one: SendOne, send_many: SendMany, take_turn: Callable[[], Turn], *, max_ops: int, max_bytes: int
    ) -> None:
        super().__init__()
        self._send_one = send_one
        self._send_many = send_many
        self._take_turn = take_turn
        self._max_ops = max_ops
        self._max_bytes = max_bytes

    async def submit(self, request: Request, size: int) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        batch = self._open.get(loop)
        if batch is None or len(batch.items) >= self._max_ops or batch.size + size > self._max_bytes:
            batch = self._open[loop] = _Batch(self._take_turn())
            # Its first step runs on the loop's next turn: every op called in this turn joins first,
            # and the POST leaves before the caller's code after its next await runs twice.
            self._track(loop.create_task(self._flush(loop, batch)))
        batch.items.append((request, future))
        batch.size += size
        return await future

    async def _flush(self, loop: asyncio.AbstractEventLoop, batch: _Batch) -> None:
        if self._open.get(loop) is batch:
            del self._open[loop]  # later ops start a batch of their own
        live = [(request, future) for request, future in batch.items if not future.done()]  # not cancelled
        if len(live) <= 1:
            if live:
                await deliver(self._send_one(live[0][0], batch.turn), live[0][1])
            batch.turn.release()  # nothing sent: the place is skipped, so later ops are not held
            return
        try:
            outcomes = await self._send_many([request for request, _ in live], batch.turn)
        except BaseException as exc:
            for _, future in live:
                if not future.done():
                    future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for (_, future), (ok, value) in zip(live, outcomes, strict=True):
            if future.done():
                continue
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)
