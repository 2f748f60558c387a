"""The protocol as plain generators, driven by a blocking or an awaiting HTTP session.

Every remote op (create a job, submit a chunk group, poll a request) is written ONCE as a
generator that yields :class:`Call` (one HTTP exchange, retried by the driver) or :class:`Sleep`
and receives a :class:`Reply`. :func:`run_sync` and :func:`run_async` drive the same generator over
``httpx.Client`` or ``httpx.AsyncClient``, so the two flavours cannot drift apart. A failed call is
thrown into the generator, which may handle it (a chunk-group replay) or let it propagate.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

__all__ = ["Call", "Exchange", "Reply", "Retry", "Sleep", "Submitted", "run_async", "run_sync"]

T = TypeVar("T")


class Retry(enum.Enum):
    """Which failures a call may be retried on (the driver's retry predicate reads this)."""

    TRANSIENT = "transient"  # connection errors, timeouts, 429, 5xx (404/409 on the managed endpoint)
    CONNECT_ONLY = "connect_only"  # only when the request provably never left (a non-idempotent create)
    NEVER = "never"


@dataclass(frozen=True, slots=True)
class Call:
    """One HTTP request relative to the API prefix, plus how to retry it."""

    method: str
    path: str  # "" = the prefix itself; "/{job_id}/step", ...
    what: str  # names the call in errors and logs, e.g. "forward-backward"
    json: Any = None
    content: bytes | None = None
    params: Mapping[str, Any] | None = None
    idempotency_key: str | None = None  # sent as Idempotency-Key; the same for every retry
    retry: Retry = Retry.TRANSIENT
    accept: frozenset[int] = frozenset()  # non-2xx statuses answered as a Reply instead of an error
    final: frozenset[int] = frozenset()  # statuses never retried for this call (e.g. 404 on delete)
    timeout_s: float | None = None  # None = the configured request timeout
    sequence: str | None = None  # sent as Icefloe-Sequence (the sequenced_submit extension)
    on_sent: Callable[[], None] | None = field(default=None, compare=False)  # the request is on the wire
    on_lost: Callable[[], None] | None = field(default=None, compare=False)  # an attempt failed (not cancelled)


@dataclass(frozen=True, slots=True)
class Reply:
    """A 2xx (or accepted) answer: its status, JSON body (None when empty) and service request id."""

    status_code: int
    body: Any = None
    service_request_id: str | None = None


@dataclass(frozen=True, slots=True)
class Sleep:
    """Wait before the next call (polling backoff)."""

    seconds: float = field(default=0.0)


@dataclass(frozen=True, slots=True)
class Submitted:
    """The service has accepted the op (it holds a request id); what follows only waits for it.

    Ops to one role must reach the service in call order; the async driver lets the next op's
    submission start from here instead of after the whole op finishes.
    """


Exchange = Generator[Call | Sleep | Submitted, Reply | None, T]


class SyncSession(Protocol):
    def send(self, call: Call) -> Reply: ...


class AsyncSession(Protocol):
    async def send(self, call: Call) -> Reply: ...


def run_sync(exchange: Exchange[T], session: SyncSession) -> T:
    """Drive ``exchange`` to completion with blocking I/O."""
    try:
        step = next(exchange)
        while True:
            if isinstance(step, Submitted):
                step = exchange.send(None)
                continue
            if isinstance(step, Sleep):
                time.sleep(max(0.0, step.seconds))
                step = exchange.send(None)
                continue
            try:
                reply = session.send(step)
            except Exception as exc:
                step = exchange.throw(exc)
            else:
                step = exchange.send(reply)
    except StopIteration as stop:
        return stop.value
    finally:
        exchange.close()


async def run_async(exchange: Exchange[T], session: AsyncSession, on_submitted: Callable[[], None] | None = None) -> T:
    """Drive ``exchange`` to completion without blocking the event loop; ``on_submitted`` at Submitted."""
    try:
        step = next(exchange)
        while True:
            if isinstance(step, Submitted):
                if on_submitted is not None:
                    on_submitted()
                step = exchange.send(None)
                continue
            if isinstance(step, Sleep):
                await asyncio.sleep(max(0.0, step.seconds))
                step = exchange.send(None)
                continue
            try:
                reply = await session.send(step)
            except Exception as exc:
                step = exchange.throw(exc)
            else:
                step = exchange.send(reply)
    except StopIteration as stop:
        return stop.value
    finally:
        exchange.close()
