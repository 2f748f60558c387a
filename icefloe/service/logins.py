"""Dashboard logins: the server-side sessions behind the login cookie, and a cap on failed attempts.

The cookie holds a random session id, never a token: a stolen cookie dies with its session (on
logout, or ``ttl_s`` after login), and the token it came from stays secret. Each session has a
CSRF token the pages send back on every change they make. Failed token checks (the login form, a
bearer token, a Tinker API key: guesses of the same secrets) are counted per client address over
the last minute; past the cap that address is refused, before its token is looked at, until the
oldest failure ages out. The address is the connection's peer (a proxy's client only where
``--forwarded-allow-ips`` trusts the proxy), so rotating ``X-Forwarded-For`` gains nothing.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

from icefloe.protocol import TooManyRequestsError

__all__ = ["SESSION_COOKIE", "Logins", "UiSession"]

SESSION_COOKIE = "icefloe_session"
_MAX_SESSIONS = 10_000  # the oldest login is dropped beyond this many
_MAX_ADDRESSES = 10_000  # failure counts kept for this many client addresses
_WINDOW_S = 60.0


@dataclass(frozen=True)
class UiSession:
    tenant: str
    caller: str  # as RequireToken records a caller: a hash of the token that logged in
    csrf_token: str
    expires_at: float  # time.monotonic()


class Logins:
    """The live dashboard sessions and recent failed logins of this process; thread-safe."""

    def __init__(self, *, ttl_s: float, max_failures_per_minute: int) -> None:
        self.ttl_s = ttl_s
        self.max_failures = max_failures_per_minute
        self._sessions: OrderedDict[str, UiSession] = OrderedDict()
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._lock = threading.Lock()

    def start(self, *, tenant: str, caller: str) -> str:
        """A new session's id, for the cookie."""
        session_id = secrets.token_urlsafe(32)
        session = UiSession(tenant, caller, secrets.token_urlsafe(24), time.monotonic() + self.ttl_s)
        with self._lock:
            self._sessions[session_id] = session
            while len(self._sessions) > _MAX_SESSIONS:
                self._sessions.popitem(last=False)
        return session_id

    def get(self, session_id: str) -> UiSession | None:
        """The live session of that id; None for an unknown, ended or expired one."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is not None and session.expires_at <= time.monotonic():
                del self._sessions[session_id]
                session = None
        return session

    def end(self, session_id: str) -> None:
        with self._lock:
            self._sessions.pop(session_id, None)

    def wait_s(self, address: str) -> float:
        """How long ``address`` must wait before its next login attempt (0: it may try now)."""
        with self._lock:
            failures = self._recent(address)
            if len(failures) < self.max_failures:
                return 0.0
            return max(0.0, failures[0] + _WINDOW_S - time.monotonic())

    def check(self, address: str) -> None:
        """Raise :class:`TooManyRequestsError`, saying how long to wait, while ``address`` must wait."""
        wait_s = self.wait_s(address)
        if wait_s > 0:
            raise TooManyRequestsError(
                f"too many failed token checks from this address; try again in {math.ceil(wait_s)} s "
                f"(at most {self.max_failures} a minute)"
            )

    def failed(self, address: str) -> None:
        with self._lock:
            self._recent(address).append(time.monotonic())
            self._failures.move_to_end(address)
            while len(self._failures) > _MAX_ADDRESSES:
                self._failures.popitem(last=False)

    def _recent(self, address: str) -> deque[float]:
        failures = self._failures.setdefault(address, deque())
        while failures and failures[0] <= time.monotonic() - _WINDOW_S:
            failures.popleft()
        return failures
