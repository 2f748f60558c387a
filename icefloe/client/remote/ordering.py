"""Submission order: an op's place in line is fixed when it is called.

A service that advertises ``sequenced_submit`` (``icefloe serve``) queues numbered POSTs
(``Icefloe-Sequence: <session>:<n>``, one counter per client session) in number order, whatever
order they arrive in: every op leaves at once. Against a service without it (the managed endpoint)
an op's POST waits until every earlier op of its roles has been accepted (holds a request id), not
until it finished, so the ops still overlap on the service's queue.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["SubmitOrder", "Turn"]


@dataclass
class Turn:
    """One op's place in line: its number, or the acceptances it waits for and the one it gives."""

    sequence: str | None = None
    before: list[asyncio.Future[None]] = field(default_factory=list)
    accepted: asyncio.Future[None] | None = None

    async def wait(self) -> None:
        if self.before:
            await asyncio.wait(self.before)

    def release(self) -> None:
        """Accepted, or ended without acceptance: the next op may send (call on the I/O loop)."""
        if self.accepted is not None and not self.accepted.done():
            self.accepted.set_result(None)


class SubmitOrder:
    """Hands out turns in call order, from any thread; an op entering no role's queue waits for nothing."""

    def __init__(self) -> None:
        self._session, self._numbers = uuid.uuid4().hex, itertools.count()
        self._last: dict[str, asyncio.Future[None]] = {}
        self._lock = threading.Lock()

    def take(self, roles: Iterable[str], *, numbered: bool, loop: asyncio.AbstractEventLoop) -> Turn:
        roles = tuple(roles)
        with self._lock:
            if not roles:
                return Turn()
            if numbered:
                return Turn(sequence=f"{self._session}:{next(self._numbers)}")
            accepted: asyncio.Future[None] = loop.create_future()
            before = [self._last[role] for role in roles if role in self._last]
            self._last.update(dict.fromkeys(roles, accepted))
            return Turn(before=before, accepted=accepted)
