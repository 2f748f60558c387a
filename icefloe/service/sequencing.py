"""Submission order across connections: the ``sequenced_submit`` extension.

Each sub-job runs its requests in arrival order. A client that pipelines ops (``fwd_bwd``, then
``step``, then the next minibatch) either waits for each POST's acceptance before sending the next,
paying a round trip per op, or sends them all at once on separate connections, where they may
arrive swapped. With this extension it sends them at once, each POST numbered by a header
``Icefloe-Sequence: <session>:<n>`` (``n`` from 0, per client session), and this layer lets POST
``n`` into the app only after POSTs ``0..n-1`` of the session have gone in and have either queued
their request or been answered. The app calls :func:`release_turn` the moment it has queued a
request, so an op held open by ``?wait=`` does not hold back the ops behind it.

A POST answered with an error its client retries (5xx, 429, a chunk group to replay) or never
answered does not let the next number in: its retry must still come first. A number that never
arrives would stall its successors: the client sends a ``sequence-skip`` operation in its place
for any op that failed before the service accepted it, and a POST that sees its session make no
progress for ``gap_timeout_s`` is refused with 409 ``sequence_gap``. A number below the session's
next one (a retry of a POST already let in) passes at once, unless the POST with that number is
still inside the app and has not queued yet: then it waits for that one, so a skip or retry cannot
move the session on before the op queued. A client sends a skip only for a POST that never reached
the service whole (the remote transport: never for one already written, whose body may still be
uploading and is not inside yet). POSTs
without the header pass straight through, exactly as before.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import OrderedDict
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from icefloe.protocol import CODE_CHUNK_GROUP_RESTART_REQUIRED
from icefloe.service.errors import error_body
from icefloe.service.middleware import header, send_json

__all__ = ["CODE_SEQUENCE_GAP", "SEQUENCE_HEADER", "SubmitOrder", "release_turn"]

SEQUENCE_HEADER = "Icefloe-Sequence"
CODE_SEQUENCE_GAP = "sequence_gap"
_HEADER_KEY = SEQUENCE_HEADER.lower().encode()
_MAX_SESSION_LENGTH = 64
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
    """Pure ASGI: holds a numbered POST until its predecessors in the session have been let through."""

    def __init__(self, app: ASGIApp, *, gap_timeout_s: float, max_sessions: int = _MAX_SESSIONS) -> None:
        self.app = app
        self.gap_timeout_s = gap_timeout_s
        self.max_sessions = max_sessions
        # session -> the number let in next; least recently used first. Never expired by time: a
        # client may stay quiet for hours (a long rollout) and must find its place kept.
        self._next: OrderedDict[str, int] = OrderedDict()
        self._progress: dict[str, list[asyncio.Future[None]]] = {}  # session -> POSTs waiting for it to advance
        # session -> numbers whose POST is inside the app and has not queued yet. Another POST with
        # such a number (a client's retry, or the skip it sends for an op whose caller gave up) waits
        # for that one: let in at once, it could release the number before the first had queued.
        self._inside: dict[str, set[int]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = header(scope, _HEADER_KEY) if scope["type"] == "http" and scope["method"] == "POST" else None
        if raw is None:
            await self.app(scope, receive, send)
            return
        parsed = _parse(raw)
        if parsed is None:
            message = (
                f"{SEQUENCE_HEADER} must be '<session>:<n>' (session: 1-{_MAX_SESSION_LENGTH} characters "
                f"without ':', n: a number from 0); got {raw[:80].decode('latin-1')!r}"
            )
            await send_json(send, 400, error_body("invalid_argument", message))
            return
        session, number = parsed
        if not await self._turn(session, number):
            message = (
                f"{SEQUENCE_HEADER} {number} of session {session} waited {self.gap_timeout_s:g} s for POST "
                f"{self._next.get(session, 0)} of the session, which never arrived; resend it, or skip it with "
                "the 'sequence-skip' operation"
            )
            await send_json(send, 409, error_body(CODE_SEQUENCE_GAP, message))
            return
        released, status, error_body_parts = False, 0, []
        inside = self._inside.setdefault(session, set())
        inside.add(number)

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                inside.discard(number)  # queued: a duplicate of this number may pass now
                self._advance(session, number)

        async def watching_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if status < 400:
                    release()  # answered without queuing anything (an inline op)
            elif message["type"] == "http.response.body" and status >= 400:
                error_body_parts.append(message.get("body", b""))
            await send(message)

        token = _RELEASE.set(release)
        try:
            await self.app(scope, receive, watching_send)
        finally:
            _RELEASE.reset(token)
            # Refused without queuing: let the next number in, unless the client will send this one
            # again (a 5xx, a 429, a chunk group to replay, or no answer at all): then its retry
            # must still come first.
            if status and not _retried(status, b"".join(error_body_parts)):
                release()
            inside.discard(number)
            if not inside and self._inside.get(session) is inside:
                del self._inside[session]
            self._wake(session)  # a POST with this number may have waited for this one to leave

    async def _turn(self, session: str, number: int) -> bool:
        """Wait until ``number`` is the next of its session; False after ``gap_timeout_s`` without progress."""
        self._touch(session)
        while number > self._next[session] or number in self._inside.get(session, ()):
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            waiters = self._progress.setdefault(session, [])
            waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, self.gap_timeout_s)
            except TimeoutError:
                return False
            finally:
                if waiter in waiters:
                    waiters.remove(waiter)
                if not waiters and self._progress.get(session) is waiters:
                    del self._progress[session]  # an empty list would keep the session from ever being evicted
            self._touch(session)
        return True

    def _touch(self, session: str) -> None:
        if session in self._next:
            self._next.move_to_end(session)
            return
        self._next[session] = 0
        while len(self._next) > self.max_sessions:
            oldest = next(iter(self._next))
            if oldest in self._progress:  # someone waits on it: keep it
                break
            del self._next[oldest]

    def _advance(self, session: str, number: int) -> None:
        if number < self._next.get(session, 0):
            return  # a retry of a POST let in before
        self._next[session] = number + 1
        self._wake(session)

    def _wake(self, session: str) -> None:
        for waiter in self._progress.pop(session, ()):
            if not waiter.done():
                waiter.set_result(None)


def _retried(status: int, body: bytes) -> bool:
    """Whether the client sends this POST again after this answer (the remote transport's retry rules)."""
    return status >= 500 or status == 429 or (status == 409 and CODE_CHUNK_GROUP_RESTART_REQUIRED.encode() in body)


def _parse(raw: bytes) -> tuple[str, int] | None:
    session, sep, number = raw.decode("latin-1").strip().rpartition(":")
    if not sep or not 0 < len(session) <= _MAX_SESSION_LENGTH or ":" in session:
        return None
    if not number.isdigit() or len(number) > 12:
        return None
    return session, int(number)
