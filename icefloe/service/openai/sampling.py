"""The one place the endpoint queues sampling, waits for it and stops it.

A request's prompts enter their model's sampling job by the door
(:func:`icefloe.service.work.door.enter`) as one :class:`~icefloe.service.work.items.Sample`, so they
are a request of that job like any other: tenant-checked, batched with the other samples of its host
(one-by-one requests linger together on an idle worker), bounded by its deadline, listed on ``/ui``
and counted in ``/metrics``. The samples stay in memory as the engines made them until the route
takes them. Every sample carries the request's tag, which stops it at its next decode step when the
caller goes away (:meth:`icefloe.engines.sampling.SamplingEngine.cancel`). A request to stream
gets the tokens decoded so far with each decode slice (:class:`~icefloe.service.hosts.seam.Progress`),
shown as text only as far as it can no longer change.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from icefloe.protocol import ConflictError, InvalidRequestError, SamplingParams
from icefloe.service.hosts.seam import Progress
from icefloe.service.jobs import JobManager, LiveJob
from icefloe.service.routes.handlers import generate_target
from icefloe.service.work.door import enter
from icefloe.service.work.items import OPENAI, Sample

__all__ = ["Ticket", "cancel", "outcome", "progress", "sample"]

_WAIT_S = 30.0  # one long-poll of the request table; a request is waited for in as many as it takes


@dataclass(frozen=True)
class Ticket:
    """A queued sampling: where it runs and the tag its samples carry."""

    job_id: str
    sub_job_id: str
    request_id: str
    tag: str
    stops: tuple[str, ...] = ()  # the stop strings its samples end at, which its progress must not show


def sample(
    manager: JobManager,
    job: LiveJob,
    tenant: str,
    prompts: list[list[int]],
    params: list[SamplingParams],
    *,
    streamed: bool = False,
) -> Ticket:
    """Queue ``params[i].n`` samples of each of ``prompts`` on ``job`` for ``tenant``; samples come back
    prompt-major. ``streamed``: its decode reports progress (see :func:`progress`)."""
    tag = uuid.uuid4().hex
    sub_job_id = generate_target(job, None)
    item = Sample(sub_job_id, prompts, [p.model_copy(update={"tag": tag}) for p in params], progress=streamed)
    request_id = enter(manager, job, item, api=OPENAI, tenant=tenant, op_metadata={"api": OPENAI})
    return Ticket(job.job_id, sub_job_id, request_id, tag, tuple(s for s in params[0].stop if s))


async def outcome(manager: JobManager, ticket: Ticket) -> list[dict[str, Any]]:
    """The samples once the request finished. Raises what its failure was: the caller's mistake
    (:class:`InvalidRequestError`) while the job still runs, else :class:`ConflictError`."""
    while True:
        row = await manager.requests.wait(ticket.job_id, ticket.request_id, _WAIT_S)
        if row["status"] not in ("pending", "running"):
            break
    if row["status"] == "done":
        try:
            return manager.held.take(ticket.request_id)
        except KeyError:  # among the oldest of a flood of held results
            raise ConflictError("the samples were not kept (too many results were waiting); send it again") from None
    error = manager.settings.public_text(row["error"] or row["status"])
    job = manager.live_job(ticket.job_id)
    if row["status"] == "failed" and job is not None and not job.stopping:
        raise InvalidRequestError(error.removeprefix("InvalidRequestError: "))
    raise ConflictError(f"the sampling did not finish ({row['status']}): {error}")


async def progress(manager: JobManager, ticket: Ticket, tokenizer: Any) -> AsyncIterator[list[dict[str, Any]]]:
    """The request's samples as they grow, each time all of them: while it runs, as decoded so far
    (``finish_reason`` None, ``text`` as far as it is final: see :func:`_settled_text`), then as
    finished. The request must have been queued ``streamed``, or this yields once, at the end."""
    grown: Progress | None = None  # every token decoded so far
    while True:
        row = await manager.requests.wait(ticket.job_id, ticket.request_id, _WAIT_S)
        if row["status"] not in ("pending", "running"):
            break
        news = manager.requests.take_news(ticket.request_id)
        for step in news:
            grown = step if grown is None else grown.then(step)
        if news and grown is not None:  # decoding every sample is the request's own work: off the loop
            yield await asyncio.to_thread(_settled, tokenizer, grown.samples, ticket.stops)
    yield await outcome(manager, ticket)


def _settled(tokenizer: Any, samples: list[dict[str, Any]], stops: tuple[str, ...]) -> list[dict[str, Any]]:
    return [{**s, "text": _settled_text(tokenizer, s["token_ids"], stops), "finish_reason": None} for s in samples]


def _settled_text(tokenizer: Any, token_ids: list[int], stops: tuple[str, ...]) -> str:
    """The text of a sample's first tokens that more tokens cannot change: cut before a stop string
    (as the engine cuts it), without a last character whose bytes are not all decoded yet, and
    without an ending that could still grow into a stop string (which the answer never shows)."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    cuts = [text.find(stop) for stop in stops if stop in text]
    if cuts:
        return text[: min(cuts)]
    text = text.rstrip("\ufffd")
    return text[: len(text) - max((_held_for(text, stop) for stop in stops), default=0)]


def _held_for(text: str, stop: str) -> int:
    """The length of the longest ending of ``text`` that begins ``stop`` without being all of it: tried
    from the longest, only where ``stop``'s first character stands, so a stop string far longer than
    the text costs no more than the text."""
    start = max(0, len(text) - len(stop) + 1)
    while (start := text.find(stop[0], start)) != -1:
        if stop.startswith(text[start:]):
            return len(text) - start
        start += 1
    return 0


def cancel(manager: JobManager, ticket: Ticket) -> None:
    """Drop the request if it has not started; stop its samples at their next decode step if it runs."""
    manager.requests.cancel(ticket.job_id, ticket.request_id, why="the client went away")
    job = manager.live_job(ticket.job_id)
    if job is not None and not job.stopping and job.host is not None and job.host.engines is not None:
        job.engines.cancel(ticket.sub_job_id, [ticket.tag])
