"""``POST {job}/operation``: the operation envelope of the training API.

Polled operations (``forward``, ``weight-sync``) answer ``{request_id, job_id}``; inline ones
(``cancel-request``, ``tail-logs``, and the engine table's ops without a route of their own, such as
``reset-prefix-cache``) answer their result directly. Operation
types this service does not run answer 501 ``not_implemented``. A polled operation posted with
``?wait=S`` (icefloe extension) also carries the request's poll answer, as the compute routes do.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Response
from fastapi.concurrency import run_in_threadpool
from pydantic import ValidationError

from icefloe.protocol import (
    ENGINE_CALLS,
    ENGINE_OPERATIONS,
    OP_FORWARD,
    OP_WEIGHT_SYNC,
    ConflictError,
    InvalidRequestError,
    UnsupportedOpError,
)
from icefloe.service.jobs import JobManager
from icefloe.service.models import CancelRequestPayload, OperationBody, TailLogsPayload, WeightSyncPayload
from icefloe.service.operations import forward_target, submit_frame, submit_weight_sync, validation_text
from icefloe.service.routes import JobsDep, api_router
from icefloe.service.routes.capabilities import SUPPORTED_OPERATIONS
from icefloe.service.routes.requests import with_answer
from icefloe.service.sequencing import release_turn
from icefloe.service.work.door import enter
from icefloe.service.work.items import EngineOp
from icefloe.wire.chunks import b64decode

__all__ = ["router", "statements_router"]

router = api_router("operations")
_INLINE_WAIT_S = 30.0  # one long-poll of an inline op's request; the route waits for as many as it takes


def _payload(model, body: OperationBody):
    try:
        return model.model_validate(body.payload or {})
    except ValidationError as exc:
        raise InvalidRequestError(f"{body.operation_type}: {validation_text(exc, prefix='payload.')}") from None


async def _engine_operation(jobs: JobManager, job_id: str, body: OperationBody, kind: str) -> dict:
    """An op of the engine table with no route of its own, answered inline: an item through the door
    like every op (a request row, its deadline, metrics), on its sub-job's lane, so it never runs in
    the middle of another op of that engine."""
    job, call = jobs.live(job_id), ENGINE_CALLS[kind]
    target = jobs.resolve_sub_job(
        job, sub_job_id=body.sub_job_id, sub_job_type=body.sub_job_type or call.role, default_type=call.role
    )
    request_id = enter(jobs, job, EngineOp(target, kind, body.payload or {}))
    release_turn()
    while jobs.requests.is_open(request_id):
        await jobs.requests.wait(job_id, request_id, _INLINE_WAIT_S)
    row = jobs.requests.get(job_id, request_id)
    if row["status"] != "done":
        raise ConflictError(f"{kind} on {target} {row['status']}: {row['error']}")
    result = json.loads(row["result"]) if row["result"] else None
    return {"sub_job_id": target, "status": "ok", **(result if isinstance(result, dict) else {})}


@router.post("/{job_id}/operation", response_model=None)
async def operation(job_id: str, body: OperationBody, jobs: JobsDep, wait: float = 0.0) -> dict | Response:
    kind = body.operation_type.strip().lower()
    if kind == "tail-logs":
        page = _payload(TailLogsPayload, body)
        return jobs.tail_logs(
            job_id,
            sub_job_id=body.sub_job_id,
            sub_job_type=body.sub_job_type,
            cursor=page.cursor,
            max_lines=page.max_lines,
        )
    if kind not in SUPPORTED_OPERATIONS:
        jobs.public(job_id)  # an unknown job is still a 404
        raise UnsupportedOpError(
            f"operation_type {body.operation_type!r} is not supported by icefloe serve; "
            f"supported: {sorted(SUPPORTED_OPERATIONS)}"
        )
    job = jobs.live(job_id)
    if kind == "cancel-request":
        request_id = _payload(CancelRequestPayload, body).request_id
        return jobs.requests.cancel(job_id, request_id, why="cancelled by cancel-request")
    if kind in ENGINE_OPERATIONS:
        return await _engine_operation(jobs, job_id, body, kind)
    if kind == OP_WEIGHT_SYNC:
        payload = _payload(WeightSyncPayload, body)
        routed = None
        if body.sub_job_id or body.sub_job_type:  # both given: they must name the same sub-job
            routed = jobs.resolve_sub_job(
                job, sub_job_id=body.sub_job_id, sub_job_type=body.sub_job_type, default_type=None
            )
        if routed is None and payload.source_sub_job_id is None:
            routed = jobs.resolve_sub_job(job, sub_job_id=None, sub_job_type=None, default_type="training")
        accepted = {"request_id": submit_weight_sync(jobs, job, payload, routed or None), "job_id": job_id}
        return await with_answer(jobs, accepted, wait)
    assert kind == OP_FORWARD
    target, reference = forward_target(jobs, job, sub_job_id=body.sub_job_id, sub_job_type=body.sub_job_type)
    encoded = (body.payload or {}).get("payload_b64")
    frame = b64decode(encoded, "forward: payload.payload_b64 (the base64 of a DSSST1 frame)", InvalidRequestError)
    accepted = await run_in_threadpool(
        submit_frame, jobs, job, OP_FORWARD, frame, sub_job_id=target, reference=reference
    )
    return await with_answer(jobs, accepted, wait)


# The managed API downloads full logs through a SQL statement that returns S3 stage credentials;
# this service has no stage, so the call answers 501 pointing at tail-logs instead of a bare 404.
statements_router = APIRouter(tags=["operations"])


@statements_router.post("/api/v2/statements")
async def statements() -> dict:
    raise UnsupportedOpError(
        "the statements API (log download from an S3 stage) is not served here; page the logs with the "
        "tail-logs operation, or read DATA_DIR/jobs/<job_id>/logs/ on the service host"
    )
