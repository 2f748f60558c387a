"""Waiting on the service: the backoff schedule, request polling and result decoding.

A result arrives as plain JSON, an inline DSSST1 envelope, or ``result_chunk`` events drained by
cursor. Where the service offers it each poll asks it to hold the answer (``?wait=``); otherwise
polls back off 0.5 s × 1.25 up to 6 s. No sleep runs past the deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from icefloe import wire
from icefloe.client.remote.errors import error_from_failed_request
from icefloe.client.remote.http import Call, Http
from icefloe.protocol import (
    REQUEST_FAILURE_STATES,
    REQUEST_SUCCESS_STATES,
    IcefloeTimeoutError,
    RequestFailedError,
    normalize_request_state,
)

__all__ = ["Backoff", "FrameResult", "decode_result", "poll_request"]

_LONG_POLL_SLACK_S = 10.0  # the HTTP timeout of a long poll exceeds its wait by this much


@dataclass(frozen=True, slots=True)
class Backoff:
    """Polling intervals: ``initial_s``, then ×``multiplier`` per idle poll, capped at ``max_s``."""

    initial_s: float = 0.5
    multiplier: float = 1.25
    max_s: float = 6.0

    def sleeps(self, deadline: float) -> Iterator[float]:
        """The intervals, clipped so that no sleep ends after ``deadline`` (a ``time.monotonic`` value)."""
        interval = self.initial_s
        while True:
            yield max(0.0, min(interval, deadline - time.monotonic()))
            interval = min(interval * self.multiplier, self.max_s)


class FrameResult(dict):
    """A result decoded from a DSSST1 frame, so it may hold tensors (a JSON result never does)."""


def decode_result(result: Any, chunk_events: list[dict[str, Any]]) -> dict[str, Any]:
    """The result from result chunks, an inline envelope or plain JSON (empty: ``{}``); tensors: torch, else numpy."""
    if chunk_events:
        decoded = wire.decode(wire.join_result_events(chunk_events))
    elif isinstance(result, Mapping) and "payload_b64" in result and "wire_format" in result:
        decoded = wire.decode_inline_result(dict(result))
    else:
        return dict(result) if isinstance(result, Mapping) else {} if result is None else {"result": result}
    if not isinstance(decoded, dict):
        raise RequestFailedError(f"the result decoded to {type(decoded).__name__}, expected a dict")
    return FrameResult(decoded)


async def poll_request(
    http: Http,
    job_id: str,
    request_id: str,
    *,
    what: str,
    backoff: Backoff,
    timeout_s: float,
    long_poll_s: float = 0.0,
    answered: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Poll ``GET /{job_id}/requests/{request_id}`` until it finishes; return the decoded result.

    ``answered`` is a poll answer the submitting POST carried: it is read first, and polling
    continues only while the request is unfinished or result chunks remain.

    Raises:
        IcefloeError: the request failed or was cancelled (message = the service's error): the
            engine's own class when the service names it (``InvalidRequestError``, ...), else
            ``RequestFailedError``.
        IcefloeTimeoutError: ``timeout_s`` passed; the request may still run on the service.
    """
    deadline = time.monotonic() + timeout_s
    sleeps = backoff.sleeps(deadline)
    events: list[dict[str, Any]] = []
    cursor = ""
    path = f"/{job_id}/requests/{request_id}"
    while True:
        remaining = deadline - time.monotonic()
        params: dict[str, Any] = {"cursor": cursor} if cursor else {}
        timeout = None
        if not cursor and long_poll_s > 0 and remaining > 0:
            wait = min(long_poll_s, remaining)
            params["wait"] = f"{wait:.3f}"
            timeout = wait + _LONG_POLL_SLACK_S
        if answered is not None:
            body, answered, held_s = answered, None, None
        else:
            asked_at = time.monotonic()
            reply = await http.send(Call("GET", path, f"{what} (poll {request_id})", params=params, timeout_s=timeout))
            held_s = time.monotonic() - asked_at
            body = reply.body if isinstance(reply.body, Mapping) else {}
        new_events = [e for e in body.get("events") or () if isinstance(e, Mapping) and e.get("type") == "result_chunk"]
        events.extend(dict(e) for e in new_events)
        next_cursor = str(body.get("next_cursor") or "")
        if next_cursor:  # more chunks queued: drain at once, status is read once drained
            cursor = next_cursor
            continue
        status = normalize_request_state(body.get("status", ""))
        if status in REQUEST_SUCCESS_STATES:
            return decode_result(body.get("result"), events)
        if status in REQUEST_FAILURE_STATES:
            error = str(body.get("error") or f"request {status}")
            raise error_from_failed_request(what, status, error, request_id=request_id)
        if time.monotonic() >= deadline:
            raise IcefloeTimeoutError(
                f"{what}: request {request_id} of job {job_id} still {status or 'pending'} after "
                f"{timeout_s:g} s; it may still run on the service (raise backend.request_timeout_s to wait "
                "longer)"
            )
        if new_events:
            continue  # a chunk arrived without a cursor: the rest is ready, re-poll at once
        if held_s is None and long_poll_s > 0:
            continue  # the POST's own wait ran out: the long poll takes over at once
        if timeout is None or held_s is None or held_s < 0.1 * (timeout - _LONG_POLL_SLACK_S):
            await asyncio.sleep(next(sleeps))  # no long poll, or the service answered early without holding it
