"""Submission order across connections: the ``sequenced_submit`` extension.

A POST numbered ``Icefloe-Sequence: <session>:<n>`` goes into the app only once POST ``n-1`` of
its session has queued its request (the app calls :func:`release_turn`) or been answered, so a
sub-job queues them in number order whatever order they arrive in. A POST answered with a status
its client retries keeps its number; a number below the session's next passes at once. After
``gap_timeout_s`` without progress the lowest POST waiting gets a 409 ``sequence_gap`` and the
session moves past its number: a lost POST fails the op waiting on it, not the session. A number
more than ``window`` past the session's next is refused at once (400), so a session holds at most a
window's worth of numbers; the number is decimal digits, at most 19 of them (the rule is
:class:`~icefloe.service.turns.Turns`, which orders the Tinker API's ``seq_id`` too). Sessions
belong to a caller (the token :class:`~icefloe.service.middleware.RequireToken` let in), and this
layer runs only after that check: an unauthenticated POST never holds or advances a session.
docs/service.md has the contract.
"""

from __future__ import annotations

import contextvars
import re
from collections import OrderedDict
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from icefloe.protocol import CODE_CHUNK_GROUP_RESTART_REQUIRED, SEQUENCE_HEADER, InvalidRequestError, SequenceGapError
from icefloe.service.errors import send_error
from icefloe.service.limits import SEQUENCE_WINDOW
from icefloe.service.middleware import CALLER_SCOPE_KEY, Recorder, header
from icefloe.service.turns import Turns

__all__ = ["SubmitOrder", "release_turn"]

_HEADER_KEY = SEQUENCE_HEADER.lower().encode()
_MAX_SESSION_LENGTH = 64
_NUMBER = re.compile(r"[0-9]{1,19}")  # ASCII digits only: str.isdigit() also takes '²', which int() refuses
_MAX_SESSIONS = 100_000  # the least recently used session is forgotten beyond this many

_RELEASE: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar(
    "icefloe_release_turn", default=None
)


def release_turn() -> None:
    """Let the next numbered POST of this request's session in (no-op for an unnumbered request)."""
    release = _RELEASE.get()
    if release is not None:
        release()


class SubmitOrder:
    """Pure ASGI: holds a numbered POST until the POST numbered before it in its session went in."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        gap_timeout_s: float,
        window: int = SEQUENCE_WINDOW,
        max_sessions: int = _MAX_SESSIONS,
        unordered: Callable[[Scope], bool] = lambda scope: False,
    ) -> None:
        """``unordered(scope)``: True for a POST whose job does not run here (it ended, or the service
        restarted and lost the session), which goes in at once to be refused with the job's reason."""
        self.app = app
        self.unordered = unordered
        self.gap_timeout_s = gap_timeout_s
        self.window = window
        self.max_sessions = max_sessions
        # Least recently used first. Never expired by time: a client may stay quiet for hours (a long
        # rollout) and must find its place kept.
        self._sessions: OrderedDict[tuple[str, str], Turns] = OrderedDict()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = header(scope, _HEADER_KEY) if scope["type"] == "http" and scope["method"] == "POST" else None
        if raw is None:
            await self.app(scope, receive, send)
            return
        session_id, _, number_text = raw.decode("latin-1").strip().rpartition(":")
        well_formed = 0 < len(session_id) <= _MAX_SESSION_LENGTH and ":" not in session_id
        if not (well_formed and _NUMBER.fullmatch(number_text)):
            message = (
                f"{SEQUENCE_HEADER} must be '<session>:<n>' (session: 1-{_MAX_SESSION_LENGTH} characters "
                f"without ':', n: 1-19 digits 0-9); got {raw[:80].decode('latin-1')!r}"
            )
            await send_error(scope, receive, send, InvalidRequestError(message))
            return
        if self.unordered(scope):
            await self.app(scope, receive, send)
            return
        number, session = int(number_text), self._session((scope.get(CALLER_SCOPE_KEY, ""), session_id))
        if session.beyond(number):  # holding it would hold every number up to it
            message = (
                f"{SEQUENCE_HEADER} {session_id}:{number} is more than the sequence window ({self.window}) past "
                f"its session's next number ({session.next}); number a session's POSTs in order from 0"
            )
            await send_error(scope, receive, send, InvalidRequestError(message))
            return
        if session.late(number):  # the ops after it already ran, so it must not
            message = (
                f"{SEQUENCE_HEADER} {session_id}:{number} came after its session moved on past it (a POST "
                f"behind it waited {self.gap_timeout_s:g} s for it); it did not run: call the op again"
            )
            await send_error(scope, receive, send, SequenceGapError(message))
            return
        missing = await session.wait(number)
        if missing is not None:
            message = (
                f"{SEQUENCE_HEADER} {session_id}:{number} waited {self.gap_timeout_s:g} s for POST "
                f"{missing} of its session, which never arrived; it did not run, and the session moves on past it"
            )
            await send_error(scope, receive, send, SequenceGapError(message))
            return
        answer = Recorder(send, keep_from_status=400)  # only a refusal's body is read below
        token = _RELEASE.set(lambda: session.use(number))
        try:
            await self.app(scope, receive, answer)
        finally:
            _RELEASE.reset(token)
        status = answer.status
        restart = status >= 400 and CODE_CHUNK_GROUP_RESTART_REQUIRED.encode() in answer.body
        if status and not (status >= 500 or status == 429 or restart):  # answered without queuing, or refused
            session.use(number)  # for good: the next may go in

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
