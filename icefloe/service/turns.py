"""The one ordering rule of the service: numbered calls of a stream go in by number.

Both APIs order a stream's calls by a number the client fixes when it makes the call: the training
API's ``Icefloe-Sequence: <session>:<n>`` (per session, from 0) and the Tinker API's ``seq_id`` (per
model, from 1). :class:`Turns` holds one stream's state. A number is *used* once its call was queued
or refused; the stream's next number is the lowest one not used. A call waits until every number
before its own was used. After ``gap_timeout_s`` without progress, the lowest call still waiting
gives up: the numbers it waited for are skipped, it counts as used, and the calls behind it go on.
A skipped number that arrives later is refused (the calls after it ran already); any other number
below the next passes at once (a resend of a call that went in). A number more than ``window`` past
the next is refused by the caller (:meth:`Turns.beyond`) before it waits, so what one stream holds is
bounded by its window: skipped numbers are kept as ranges, never one by one.
"""

from __future__ import annotations

import asyncio
import bisect

from icefloe.service.limits import SEQUENCE_WINDOW

__all__ = ["Turns"]

_MAX_SKIPPED_RANGES = 4096  # past this many, the oldest skipped range is forgotten (it then passes as a resend)


class Turns:
    """One stream's numbers: which is next, which were used ahead of it, which were skipped."""

    __slots__ = ("_skipped", "_used", "_waiting", "gap_timeout_s", "next", "window")

    def __init__(self, *, gap_timeout_s: float, window: int = SEQUENCE_WINDOW, first: int = 0) -> None:
        self.gap_timeout_s = gap_timeout_s
        self.window = window
        self.next = first
        self._used: set[int] = set()  # numbers above ``next`` used already (refused ahead of their turn)
        # Numbers the stream moved past without them: sorted, disjoint [start, stop) ranges.
        self._skipped: list[tuple[int, int]] = []
        self._waiting: dict[asyncio.Future[None], int] = {}  # calls waiting for their turn: their numbers

    @property
    def busy(self) -> bool:
        """A call waits on this stream (it must not be forgotten)."""
        return bool(self._waiting)

    def beyond(self, number: int) -> bool:
        """True for a number more than ``window`` past the next: its call must be refused, not held."""
        return number > self.next + self.window

    def late(self, number: int) -> bool:
        """True for a number the stream skipped: its call must be refused (once; a resend is new)."""
        index = bisect.bisect_right(self._skipped, (number, float("inf"))) - 1
        if index < 0 or not self._skipped[index][0] <= number < self._skipped[index][1]:
            return False
        start, stop = self._skipped[index]
        self._skipped[index : index + 1] = [(a, b) for a, b in ((start, number), (number + 1, stop)) if a < b]
        return True

    def use(self, number: int) -> None:
        """``number`` was queued or refused: the stream moves past it once the numbers before it are used."""
        if number >= self.next:
            self._used.add(number)
            self._advance(self.next)

    async def wait(self, number: int) -> int | None:
        """Return None once every number before ``number`` was used. After ``gap_timeout_s`` without
        progress, the lowest call waiting returns the number it waited for in vain instead; the stream
        then skips the missing numbers and counts ``number`` as used (the others wait on)."""
        while number > self.next:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiting[waiter] = number
            try:
                await asyncio.wait_for(waiter, self.gap_timeout_s)
            except TimeoutError:
                if number <= min(self._waiting.values()):
                    missing = self.next
                    self._skip(missing, number)
                    self._used.add(number)
                    self._advance(number)
                    return missing
            finally:
                del self._waiting[waiter]
        return None

    def _skip(self, start: int, stop: int) -> None:
        """Record [start, stop) as skipped, but for the numbers used ahead of their turn."""
        for used in sorted(n for n in self._used if start <= n < stop):
            if start < used:
                self._skipped.append((start, used))
            start = used + 1
        if start < stop:
            self._skipped.append((start, stop))
        self._skipped.sort()  # ranges only ever come from above the next, so this is nearly sorted
        del self._skipped[: max(0, len(self._skipped) - _MAX_SKIPPED_RANGES)]

    def _advance(self, floor: int) -> None:
        start, self.next = self.next, max(self.next, floor)
        while self.next in self._used:
            self._used.discard(self.next)
            self.next += 1
        if self.next == start:
            return
        if self._used:  # a jump past numbers used ahead of their turn: they are behind it now
            self._used = {n for n in self._used if n > self.next}
        for waiter in self._waiting:
            if not waiter.done():
                waiter.set_result(None)
