"""Submission order per role: ops to one sub-job reach the service in the order they were called.

Over HTTP, two ops sent at once (``fwd_bwd`` then ``step``, awaited together) travel on separate
connections and may arrive swapped; the service runs each sub-job's requests in ARRIVAL order, so
the step could run before the gradients exist. A :class:`Turn` makes an op's POST wait until every
earlier op of its roles has been accepted (holds a request id) — not until it has finished, so the
ops still overlap on the service's queue. A turn also records whether a later op queued behind it
(``followed``): only an op nobody waits on may ask the service to hold its answer until it finishes.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["RoleTurns", "Turn"]


@dataclass
class Turn:
    """One op's place in line: the submissions it waits for, and the one it resolves."""

    before: set[asyncio.Future]
    mine: asyncio.Future
    followed: bool = False  # a later op of one of these roles has taken its turn

    async def wait(self) -> None:
        if self.before:
            await asyncio.wait(self.before)  # never cancels the others' futures

    def release(self) -> None:
        if not self.mine.done():
            self.mine.set_result(None)


class RoleTurns:
    """The last submission per (event loop, role); ``take`` queues a new op behind it."""

    def __init__(self) -> None:
        self._tails: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, Turn]] = weakref.WeakKeyDictionary()

    def take(self, roles: Iterable[str]) -> Turn:
        loop = asyncio.get_running_loop()
        tails = self._tails.setdefault(loop, {})
        turn = Turn(set(), loop.create_future())
        for role in roles:
            previous = tails.get(role)
            if previous is not None:
                previous.followed = True
                if not previous.mine.done():
                    turn.before.add(previous.mine)
            tails[role] = turn
        return turn
