"""Submission order per role: ops to one sub-job reach the service's queue in the order they were called.

Over HTTP, two ops sent at once (``fwd_bwd`` then ``step``, awaited together) travel on separate
connections and may arrive swapped; the service runs each sub-job's requests in ARRIVAL order, so
the step could run before the gradients exist. Two ways to keep call order:

- A service with the ``sequenced_submit`` extension (``icefloe serve``) takes each op's POST
  numbered (``Icefloe-Sequence: <session>:<n>``) and queues the POSTs in number order, whatever
  order they arrive in. An op's POST goes as soon as the one before it is written to its socket,
  not accepted: ops that all start at once would otherwise build their requests in turns, and the
  first would leave only after the last was built. An op that fails before the service answers its
  numbered POST reports the number as unanswered, so the transport can send a skip in its place
  (unless its caller gave up after the POST was written: the service gets that POST anyway)
  and the ops behind it are not held.
- Otherwise (the managed endpoint) an op's POST waits until every earlier op of its roles has
  been accepted (holds a request id) — not until it has finished, so the ops still overlap on the
  service's queue. A turn also records whether a later op queued behind it (``followed``): only an
  op nobody waits on may ask the service to hold its answer until it finishes.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["RoleTurns", "Turn"]


@dataclass
class Turn:
    """One op's place in line: the submissions it waits for, and the one it resolves."""

    before: set[asyncio.Future]
    mine: asyncio.Future
    followed: bool = False  # a later op of one of these roles has taken its turn
    sequence: str | None = None  # the op's Icefloe-Sequence, when the service orders numbered POSTs
    on_unanswered: Callable[[str], None] | None = None  # told the number of an op the service never accepted
    answered: bool = False
    sent: asyncio.Future | None = None  # numbered: resolved once the op's POST is on the wire
    delivered: bool = False  # the latest attempt of the numbered POST was written and has not failed

    @property
    def may_hold(self) -> bool:
        """Whether the op may ask the service to hold its answer (``?wait=``) without delaying others."""
        return self.sequence is not None or not self.followed

    async def wait(self) -> None:
        if self.before:
            await asyncio.wait(self.before)  # never cancels the others' futures

    def written(self) -> None:
        """The numbered POST is on the wire: the next op may send its own."""
        self.delivered = True
        if self.sent is not None and not self.sent.done():
            self.sent.set_result(None)

    def accepted(self) -> None:
        """The service accepted the op: the next op's POST may go."""
        self.answered = True
        self.release()

    def lost(self) -> None:
        """An attempt of the numbered POST failed after it was written: the service may never have
        had it whole, so a skip is due again unless a retry is written."""
        self.delivered = False

    def given_up(self) -> None:
        """The caller stopped waiting (cancelled). A POST whose last attempt was written still
        reaches the service, which then uses its number itself: a skip sent for it could get in
        while its body still uploads and let the ops behind it overtake it."""
        if self.delivered:
            self.answered = True

    def release(self) -> None:
        """Called once the op is accepted or has ended; a numbered op never accepted reports its number."""
        if not self.mine.done():
            self.mine.set_result(None)
        self.written()
        if self.sequence is not None and not self.answered and self.on_unanswered is not None:
            report, self.on_unanswered = self.on_unanswered, None
            report(self.sequence)


class RoleTurns:
    """The last submission per (event loop, role); ``take`` queues a new op behind it.

    ``take(roles, numbered=True)`` (the service orders numbered POSTs) hands out the next number
    of this session instead, in call order, and nothing waits; ``on_unanswered`` is told the number
    of a numbered op the service never accepted.
    """

    def __init__(self, on_unanswered: Callable[[str], None] | None = None) -> None:
        self._tails: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, Turn]] = weakref.WeakKeyDictionary()
        self._last_numbered: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Turn] = weakref.WeakKeyDictionary()
        self._session = uuid.uuid4().hex
        self._numbers = itertools.count()
        self._on_unanswered = on_unanswered

    def take(self, roles: Iterable[str], *, numbered: bool = False) -> Turn:
        loop = asyncio.get_running_loop()
        roles = tuple(roles)
        if numbered and roles:
            previous = self._last_numbered.get(loop)
            before = {previous.sent} if previous is not None and previous.sent and not previous.sent.done() else set()
            turn = Turn(
                before,
                loop.create_future(),
                sequence=f"{self._session}:{next(self._numbers)}",
                on_unanswered=self._on_unanswered,
                sent=loop.create_future(),
            )
            self._last_numbered[loop] = turn
            return turn
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
