"""Submission order across connections: the ``sequenced_submit`` extension, taken by each route.

A POST numbered ``Icefloe-Sequence: <session>:<n>`` gets its turn (:meth:`Sequencing.turn`) only once
POST ``n-1`` of its session queued its request or was answered, so a sub-job queues them in number
order whatever order they arrive in. The route holds the :class:`Turn` and calls :meth:`Turn.release`
the moment its request is queued; a route that answers without queuing releases it by returning.
A route that raises decides by the error's type: one its client retries (a 5xx, a 429,
``chunk_group_restart_required``, see :func:`~icefloe.service.errors.retried`) keeps its number for
the retry, any other refusal uses it. A number below the session's next passes at once. After
``gap_timeout_s`` without progress the lowest POST waiting gets a 409 ``sequence_gap`` and the
session moves past its number: a lost POST fails the op waiting on it, not the session. A number
more than ``window`` past the session's next is refused at once (400), so a session holds at most a
window's worth of numbers; the number is decimal digits, at most 19 of them (the rule is
:class:`~icefloe.service.turns.Turns`, which orders the Tinker API's ``seq_id`` too). Sessions belong
to a caller (the token :class:`~icefloe.service.middleware.RequireToken` let in, before any route
runs). A layer in front of the routes that refuses a POST of a caller it let in (a body too large,
malformed JSON, an ``Idempotency-Key`` conflict) tells :meth:`Sequencing.refused`, which uses or keeps
its number by the same rule. docs/service.md has the contract.
"""

from __future__ import annotations

import contextlib
import re
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable

from starlette.types import Scope

from icefloe.protocol import SEQUENCE_HEADER, InvalidRequestError, SequenceGapError
from icefloe.service.errors import retried
from icefloe.service.limits import SEQUENCE_WINDOW
from icefloe.service.middleware import CALLER_SCOPE_KEY, header
from icefloe.service.turns import Turns

__all__ = ["Sequencing", "Turn"]

_HEADER_KEY = SEQUENCE_HEADER.lower().encode()
_MAX_SESSION_LENGTH = 64
_NUMBER = re.compile(r"[0-9]{1,19}")  # ASCII digits only: str.isdigit() also takes '²', which int() refuses
_MAX_SESSIONS = 100_000  # the least recently used session is forgotten beyond this many


class Turn:
    """A numbered POST's place in its session, held by the route while it runs."""

    __slots__ = ("_number", "_session")

    def __init__(self, session: Turns | None = None, number: int = 0) -> None:
        self._session, self._number = session, number

    def release(self) -> None:
        """The request is queued (or answered): the next numbered POST of the session may go in.
        A no-op for an unnumbered POST, and when called again."""
        if self._session is not None:
            self._session.use(self._number)


class Sequencing:
    """The sessions of numbered POSTs, one :class:`Turns` per (caller, session id)."""

    def __init__(
        self,
        *,
        gap_timeout_s: float,
        window: int = SEQUENCE_WINDOW,
        max_sessions: int = _MAX_SESSIONS,
        unordered: Callable[[Scope], bool] = lambda scope: False,
    ) -> None:
        """``unordered(scope)``: True for a POST whose job does not run here (it ended, or the service
        restarted and lost the session), which goes in at once to be refused with the job's reason."""
        self.unordered = unordered
        self.gap_timeout_s = gap_timeout_s
        self.window = window
        self.max_sessions = max_sessions
        # Least recently used first. Never expired by time: a client may stay quiet for hours (a long
        # rollout) and must find its place kept.
        self._sessions: OrderedDict[tuple[str, str], Turns] = OrderedDict()

    @contextlib.asynccontextmanager
    async def turn(self, scope: Scope) -> AsyncIterator[Turn]:
        """Wait for the request's turn and hold it while the route runs.

        Raises:
            InvalidRequestError: the header is malformed, or its number is beyond the window.
            SequenceGapError: the number was skipped, or a number before it never came.
        """
        raw = header(scope, _HEADER_KEY) if scope["method"] == "POST" else None
        if raw is None:
            yield Turn()
            return
        numbered = _parse(raw)
        if numbered is None:
            raise InvalidRequestError(
                f"{SEQUENCE_HEADER} must be '<session>:<n>' (session: 1-{_MAX_SESSION_LENGTH} characters "
                f"without ':', n: 1-19 digits 0-9); got {raw[:80].decode('latin-1')!r}"
            )
        if self.unordered(scope):
            yield Turn()
            return
        session_id, number = numbered
        session = self._session((scope.get(CALLER_SCOPE_KEY, ""), session_id))
        if session.beyond(number):  # holding it would hold every number up to it
            raise InvalidRequestError(
                f"{SEQUENCE_HEADER} {session_id}:{number} is more than the sequence window ({self.window}) past "
                f"its session's next number ({session.next}); number a session's POSTs in order from 0"
            )
        if session.late(number):  # the ops after it already ran, so it must not
            raise SequenceGapError(
                f"{SEQUENCE_HEADER} {session_id}:{number} came after its session moved on past it (a POST "
                f"behind it waited {self.gap_timeout_s:g} s for it); it did not run: call the op again"
            )
        missing = await session.wait(number)
        if missing is not None:
            raise SequenceGapError(
                f"{SEQUENCE_HEADER} {session_id}:{number} waited {self.gap_timeout_s:g} s for POST "
                f"{missing} of its session, which never arrived; it did not run, and the session moves on past it"
            )
        turn = Turn(session, number)
        try:
            yield turn
        except Exception as refused:
            if not retried(refused):  # refused for good: the client never sends it again
                turn.release()
            raise
        else:
            turn.release()  # answered without queuing (or queued, and released already)

    def refused(self, scope: Scope, refusal: Exception) -> None:
        """A layer in front of the routes refused this request: a numbered POST uses its number at once
        (the POSTs after it need not wait for it), or keeps it when its client retries it
        (:func:`~icefloe.service.errors.retried`). Only for a caller the token check let in (it set
        :data:`CALLER_SCOPE_KEY`): an unauthenticated POST never touches a session."""
        caller = scope.get(CALLER_SCOPE_KEY)
        raw = header(scope, _HEADER_KEY) if scope.get("method") == "POST" else None
        numbered = None if caller is None or raw is None or retried(refusal) else _parse(raw)
        if numbered is None:  # unnumbered, not let in, retried, or a malformed header (nothing to use)
            return
        session_id, number = numbered
        session = self._session((caller, session_id))
        if not session.beyond(number):  # beyond the window: the route would never have held it
            session.use(number)

    def _session(self, key: tuple[str, str]) -> Turns:
        """The session of (caller, session id), made on first use."""
        session = self._sessions.get(key)
        if session is not None:
            self._sessions.move_to_end(key)
            return session
        session = self._sessions[key] = Turns(gap_timeout_s=self.gap_timeout_s, window=self.window)
        while len(self._sessions) > self.max_sessions:
            oldest_id, oldest = next(iter(self._sessions.items()))
            if oldest.busy:  # someone waits on it: keep it
                break
            del self._sessions[oldest_id]
        return session


def _parse(raw: bytes) -> tuple[str, int] | None:
    """(session id, number) of an ``Icefloe-Sequence`` value; None when it is malformed."""
    session_id, _, number_text = raw.decode("latin-1").strip().rpartition(":")
    well_formed = 0 < len(session_id) <= _MAX_SESSION_LENGTH and ":" not in session_id
    return (session_id, int(number_text)) if well_formed and _NUMBER.fullmatch(number_text) else None
