"""Poll a request: status, then its result (JSON, inline DSSST1, or result-chunk pages).

:func:`answer_request` builds the poll answer; the submitting POST routes reuse it for the
``?wait=`` extension, so a request that finishes quickly is answered by the POST itself. A JSON
result is stored as text and spliced into the answer as it is (:func:`answer_response`): a
generate result holds thousands of values, and decoding then re-encoding them cost milliseconds.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from fastapi import Response
from fastapi.concurrency import run_in_threadpool

from icefloe.service.jobs import JobManager
from icefloe.service.middleware import ACCEPTED_HEADER
from icefloe.service.results import DEFAULT_MAX_EVENTS, MAX_EVENTS_CAP, JsonText
from icefloe.service.routes import JobsDep, api_router
from icefloe.service.schemas import RequestPublic
from icefloe.service.sequencing import Turn

__all__ = ["answer_request", "answer_response", "router", "with_answer"]

router = api_router("requests")


def answer_response(answer: dict[str, Any]) -> Response:
    """The answer as a JSON response, its ``result`` spliced in when it is already JSON text."""
    result = answer.get("result")
    if not isinstance(result, JsonText):
        return Response(orjson.dumps(answer), media_type="application/json")
    head = orjson.dumps({k: v for k, v in answer.items() if k != "result"})
    return Response(b'%s,"result":%s}' % (head[:-1], result.encode()), media_type="application/json")


async def answer_request(
    jobs: JobManager,
    job_id: str,
    request_id: str,
    *,
    wait: float,
    cursor: str | None = None,
    max_events: int = DEFAULT_MAX_EVENTS,
) -> dict[str, Any]:
    """The poll answer of a request, after holding up to ``wait`` seconds for it to finish."""
    jobs.renew(job_id)
    stream = jobs.streams.get(request_id)
    if stream is not None and stream.job_id != job_id:  # another job's request: the table answers 404
        stream = None
    if stream is not None and stream.pending_events:
        wait = 0.0  # events are ready now; a long-poll would only delay them
    row = await jobs.requests.wait(job_id, request_id, min(max(0.0, wait), jobs.settings.max_long_poll_s))
    result, events, next_cursor, status = {}, [], "", row["status"]
    limit = min(max(1, max_events), MAX_EVENTS_CAP)
    if stream is not None:  # generate-stream: events are drained, the request stays "streaming" until empty
        events = stream.drain(limit)
        if stream.pending_events or status != "done":
            status = "streaming" if status in ("done", "streaming") else status
        else:
            result = json.loads(row["result"]) if row["result"] else {}
            jobs.streams.pop(request_id, None)
    elif status == "done" and row["result_path"] is None:
        result = JsonText(row["result"]) if row["result"] else {}  # JSON text, spliced in as it is
    elif status == "done":  # a stored frame, read off the loop
        render = jobs.results.render
        args = (request_id, row["result_path"], row["op_metadata"], cursor, limit)
        result, events, next_cursor = await run_in_threadpool(render, *args)
    return {
        "request_id": request_id,
        "status": status,
        "created_at": row["created_at"],
        "updated_at": row["updated_at"],
        "result": result,
        "error": jobs.settings.public_text(row["error"]) if row["error"] else row["error"],
        "events": events,
        "next_cursor": next_cursor,
    }


async def with_answer(jobs: JobManager, accepted: dict[str, Any], wait: float, turn: Turn) -> dict[str, Any] | Response:
    """``accepted`` plus the request's poll answer when the POST asked to wait (icefloe extension).

    The request is queued, so ``turn`` is released first: the next numbered POST of its session may
    go in while this one waits. A non-final request chunk (no ``request_id``) or ``wait`` ≤ 0 answers
    ``accepted`` unchanged, exactly as the managed endpoint does. A waited answer names what was
    accepted in :data:`ACCEPTED_HEADER`, which the idempotency layer keeps when the answer is too large.
    """
    turn.release()
    request_id = accepted.get("request_id")
    if wait <= 0 or not request_id:
        return accepted
    answer = await answer_request(jobs, accepted["job_id"], str(request_id), wait=wait)
    response = answer_response({**accepted, **answer})
    response.headers[ACCEPTED_HEADER] = orjson.dumps({"request_id": request_id, "job_id": accepted["job_id"]}).decode()
    return response


@router.get("/{job_id}/requests/{request_id}", response_model=RequestPublic)
async def get_request(
    job_id: str,
    request_id: str,
    jobs: JobsDep,
    max_events: int = DEFAULT_MAX_EVENTS,
    cursor: str | None = None,
    wait: float = 0.0,
) -> Response:
    """``?wait=S`` (icefloe extension) holds the answer until the request finishes or S seconds pass."""
    return answer_response(
        await answer_request(jobs, job_id, request_id, wait=wait, cursor=cursor, max_events=max_events)
    )
