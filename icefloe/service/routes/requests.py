"""Poll a request: status, then its result (JSON, inline DSSST1, or result-chunk pages)."""

from __future__ import annotations

from fastapi.concurrency import run_in_threadpool

from icefloe.service.deps import JobsDep
from icefloe.service.models import RequestPublic
from icefloe.service.results import DEFAULT_MAX_EVENTS, MAX_EVENTS_CAP
from icefloe.service.routes.common import api_router

__all__ = ["router"]

router = api_router("requests")


@router.get("/{job_id}/requests/{request_id}", response_model=RequestPublic)
async def get_request(
    job_id: str,
    request_id: str,
    jobs: JobsDep,
    max_events: int = DEFAULT_MAX_EVENTS,
    cursor: str | None = None,
    wait: float = 0.0,
) -> dict:
    """``?wait=S`` (icefloe extension) holds the answer until the request finishes or S seconds pass."""
    stream = jobs.streams.get(request_id)
    if stream is not None and stream.pending_events:
        wait = 0.0  # events are ready now; a long-poll would only delay them
    row = await jobs.wait_for_request(job_id, request_id, max(0.0, wait))
    result, events, next_cursor, status = {}, [], "", row["status"]
    limit = min(max(1, max_events), MAX_EVENTS_CAP)
    if stream is not None:  # generate-stream: events are drained, the request stays "streaming" until empty
        events = stream.drain(limit)
        if stream.pending_events or status != "done":
            status = "streaming" if status in ("done", "streaming") else status
        else:
            result = row["result"] or {}
            jobs.streams.pop(request_id, None)
    elif status == "done":
        result, events, next_cursor = await run_in_threadpool(
            jobs.results.render,
            request_id=request_id,
            result=row["result"],
            result_path=row["result_path"],
            op_metadata=row["op_metadata"],
            cursor=cursor,
            max_events=limit,
        )
    return {
        "request_id": request_id,
        "status": status,
        "created_at": row["created_at"],
        "updated_at": row["updated_at"],
        "result": result,
        "error": row["error"],
        "events": events,
        "next_cursor": next_cursor,
    }
