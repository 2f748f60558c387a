"""Poll a request: status, then its result (JSON, inline DSSST1, or result-chunk pages).

:func:`answer_request` builds the poll answer; the submitting POST routes reuse it for the
``?wait=`` extension, so a request that finishes quickly is answered by the POST itself. A request
stores its engine's result as the engine made it; the answer puts it in the training API's envelope
(:func:`enveloped`: its job, a step's ``global_steps``, paths a caller may read). A generate's
samples are stored as JSON text and spliced into the answer as they are (:func:`answer_response`):
they hold thousands of values, and decoding then re-encoding them cost milliseconds.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import orjson
from fastapi import Response
from fastapi.concurrency import run_in_threadpool

from icefloe import wire
from icefloe.protocol import OP_FWD_BWD, OP_GENERATE, OP_LOAD, OP_SAVE, OP_STEP
from icefloe.service.jobs import JobManager
from icefloe.service.middleware import ACCEPTED_HEADER
from icefloe.service.results import DEFAULT_MAX_EVENTS, MAX_EVENTS_CAP, JsonText
from icefloe.service.routes import JobsDep, api_router
from icefloe.service.schemas import RequestPublic
from icefloe.service.sequencing import Turn
from icefloe.service.settings import ServeSettings

__all__ = ["answer_request", "answer_response", "enveloped", "router", "with_answer"]

router = api_router("requests")


def answer_response(answer: dict[str, Any]) -> Response:
    """The answer as a JSON response, each of its values that is already JSON text spliced in."""
    texts = {key: value for key, value in answer.items() if isinstance(value, JsonText)}
    if not texts:
        return Response(orjson.dumps(answer), media_type="application/json")
    head = orjson.dumps({k: v for k, v in answer.items() if k not in texts})
    tail = b"".join(b",%s:%s" % (orjson.dumps(key), text.encode()) for key, text in texts.items())
    return Response(b"%s%s}" % (head[:-1], tail), media_type="application/json")


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
        events = _events_text(stream.drain(limit), job_id)
        if stream.pending_events or status != "done":
            status = "streaming" if status in ("done", "streaming") else status
        else:
            result = json.loads(row["result"]) if row["result"] else {}
            jobs.streams.close(request_id)
    elif status == "done" and row["result_path"] is None:
        result = _stored_answer(row, jobs.settings) if row["result"] else {}
    elif status == "done":  # a stored frame, read off the loop
        render, op = jobs.results.render, row["op"]
        envelope = None if op not in _ENVELOPED else functools.partial(_frame_answer, op, job_id, jobs.settings)
        args = (request_id, row["result_path"], row["op_metadata"], cursor, limit, envelope)
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


def enveloped(op: str, job_id: str, result: Any, settings: ServeSettings) -> Any:
    """The training API's answer to a finished ``op`` of ``job_id`` whose engine made ``result``."""
    if op == OP_FWD_BWD:
        return {"job_id": job_id, **result, "post_process_outputs": {}}
    if op == OP_STEP:
        return {"job_id": job_id, "global_steps": result["global_step"], "last_lr": result["lr"], **result}
    if op == OP_SAVE:
        path = settings.public_path(result["path"])
        return {"job_id": job_id, "checkpoint_path": path, "checkpoint_tag": result["checkpoint_id"], **result,
                "path": path}  # fmt: skip
    if op == OP_LOAD:  # the answer names no server folder
        public = {"path": settings.public_path(result["path"])} if "path" in result else {}
        return {"job_id": job_id, **result, **public}
    if op == OP_GENERATE:
        return {"job_id": job_id, "results": result}
    return result


_ENVELOPED = frozenset({OP_FWD_BWD, OP_STEP, OP_SAVE, OP_LOAD, OP_GENERATE})


def _stored_answer(row: dict[str, Any], settings: ServeSettings) -> Any:
    """The answer to a request whose row holds its result as JSON text; a generate's samples are spliced
    into their envelope as they are, a result needing none is answered as it is."""
    text, op = row["result"], row["op"]
    if op == OP_GENERATE and text.startswith("["):  # (a row an earlier version wrote holds its envelope)
        return JsonText(_generate_answer(row["job_id"], text))
    if op in _ENVELOPED and op != OP_GENERATE:
        return enveloped(op, row["job_id"], orjson.loads(text), settings)
    return JsonText(text)


def _frame_answer(op: str, job_id: str, settings: ServeSettings, frame: bytes) -> bytes:
    """A stored DSSST1 frame of the engine's result, as the frame of the answer."""
    return wire.encode(enveloped(op, job_id, wire.decode(frame, tensors="torch"), settings))


def _events_text(events: list[dict[str, Any]], job_id: str) -> JsonText:
    """Generate-stream events as the training API shows them: a prompt's samples (JSON text each) in a
    generate's envelope."""
    return JsonText("[" + ",".join(_event_text(event, job_id) for event in events) + "]")


def _event_text(event: dict[str, Any], job_id: str) -> str:
    if event["type"] != "result":
        return orjson.dumps(event).decode()
    result = _generate_answer(job_id, "[" + ",".join(event["result"]) + "]")
    return f'{{"type": "result", "index": {event["index"]}, "result": {result}}}'


def _generate_answer(job_id: str, samples: str) -> str:
    """A generate's answer around its samples' JSON text (an array)."""
    return f'{{"job_id": {json.dumps(job_id)}, "results": {samples}}}'


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
