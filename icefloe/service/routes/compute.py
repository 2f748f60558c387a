"""The data plane: forward-backward, forward, step, save, load, generate.

Octet bodies over ``limits.CHECK_ON_LOOP_BYTES`` decode on a thread-pool thread, smaller ones on the loop. Every route
answers ``{request_id, job_id}`` (or ``{chunk_cached: true}`` for a non-final chunk); ``?wait=S``
adds the request's poll answer once it finishes, or after S seconds.

The two ops of every training step are also dispatched by plain Starlette routes (:data:`STEP_ROUTES`,
matched first), which call the documented FastAPI routes below with the same arguments: FastAPI's
routing and dependency solving cost about a seventh of the service's CPU per op on a small model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from fastapi import Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.routing import Route

from icefloe import wire
from icefloe.protocol import OP_FORWARD, OP_FWD_BWD, OP_GENERATE
from icefloe.service.jobs import JobManager, LiveJob
from icefloe.service.limits import CHECK_ON_LOOP_BYTES, check_frame_header
from icefloe.service.routes import (
    API_PREFIX,
    JobsDep,
    JsonOctetBody,
    OctetBody,
    TenancyDep,
    TenantDep,
    TurnDep,
    api_router,
    frame_body,
    json_of,
    visible_job,
)
from icefloe.service.routes.handlers import (
    forward_target,
    load_target,
    submit_frame,
    submit_generate_stream,
    submit_load,
    submit_save,
    submit_step,
)
from icefloe.service.routes.requests import with_answer
from icefloe.service.schemas import LoadBody, RequestAccepted, SaveBody, StepBody
from icefloe.service.sequencing import Turn

__all__ = ["STEP_ROUTES", "router"]

router = api_router("compute")
_SECONDS = TypeAdapter(float)


async def _submit(
    jobs: JobManager, job: LiveJob, op: str, body: bytes, *, sub_job_id: str | None, reference: bool = False
) -> dict:
    """Decode on the loop a small frame that is whole, or the only chunk of its group (a final chunk joins all)."""
    submit = functools.partial(submit_frame, jobs, job, op, body, sub_job_id=sub_job_id, reference=reference)
    if len(body) > CHECK_ON_LOOP_BYTES:  # a thread-pool hop costs more than decoding a smaller frame
        return await run_in_threadpool(submit)
    check_frame_header(body)
    header = wire.read_header(body)
    descriptor = wire.chunk_descriptor(body, header)
    if descriptor is not None and descriptor.get("total_chunks") != 1:
        return await run_in_threadpool(submit, header=header)
    return submit(header=header)


async def _on_training(
    jobs: JobManager, job_id: str, submit: Callable[..., str], body: Any, wait: float, turn: Turn
) -> Any:
    """Queue a JSON op on the job's training sub-job and answer it."""
    job = jobs.live(job_id)
    target = jobs.resolve_sub_job(job, sub_job_id=None, sub_job_type=None, default_type="training")
    return await with_answer(jobs, {"request_id": submit(jobs, job, body, target), "job_id": job_id}, wait, turn)


@router.post("/{job_id}/forward-backward", response_model=None)
async def forward_backward(
    job_id: str, body: OctetBody, jobs: JobsDep, turn: TurnDep, sub_job_id: str | None = None, wait: float = 0.0
) -> dict | Response:
    job = jobs.live(job_id)
    target = jobs.resolve_sub_job(job, sub_job_id=sub_job_id, sub_job_type=None, default_type="training")
    return await with_answer(jobs, await _submit(jobs, job, OP_FWD_BWD, body, sub_job_id=target), wait, turn)


@router.post("/{job_id}/forward", response_model=None)
async def forward(
    job_id: str,
    body: OctetBody,
    jobs: JobsDep,
    turn: TurnDep,
    sub_job_id: str | None = None,
    sub_job_type: str | None = None,
    wait: float = 0.0,
) -> dict | Response:
    job = jobs.live(job_id)
    target, reference = forward_target(jobs, job, sub_job_id=sub_job_id, sub_job_type=sub_job_type)
    submitted = await _submit(jobs, job, OP_FORWARD, body, sub_job_id=target, reference=reference)
    return await with_answer(jobs, submitted, wait, turn)


@router.post("/{job_id}/generate", response_model=None)
async def generate(
    job_id: str, body: OctetBody, jobs: JobsDep, turn: TurnDep, sub_job_id: str | None = None, wait: float = 0.0
) -> dict | Response:
    job = jobs.live(job_id)
    if sub_job_id is not None:  # else the body's routing_key picks the sampling sub-job
        jobs.resolve_sub_job(job, sub_job_id=sub_job_id, sub_job_type="sampling", default_type="sampling")
    return await with_answer(jobs, await _submit(jobs, job, OP_GENERATE, body, sub_job_id=sub_job_id), wait, turn)


@router.post("/{job_id}/generate-stream")
async def generate_stream(job_id: str, body: JsonOctetBody, jobs: JobsDep, sub_job_id: str | None = None) -> dict:
    """UTF-8 JSON sent as octet-stream; results are drained from the request's events as they finish."""
    job = jobs.live(job_id)
    if sub_job_id is not None:
        jobs.resolve_sub_job(job, sub_job_id=sub_job_id, sub_job_type="sampling", default_type="sampling")
    return await run_in_threadpool(submit_generate_stream, jobs, job, body, sub_job_id=sub_job_id)


@router.post("/{job_id}/step", response_model=RequestAccepted, response_model_exclude_none=True)
async def step(
    job_id: str, jobs: JobsDep, turn: TurnDep, body: StepBody | None = None, wait: float = 0.0
) -> dict | Response:
    return await _on_training(jobs, job_id, submit_step, body or StepBody(), wait, turn)


@router.post("/{job_id}/save", response_model=RequestAccepted, response_model_exclude_none=True)
async def save(
    job_id: str, jobs: JobsDep, turn: TurnDep, body: SaveBody | None = None, wait: float = 0.0
) -> dict | Response:
    return await _on_training(jobs, job_id, submit_save, body or SaveBody(), wait, turn)


@router.post("/{job_id}/load", response_model=RequestAccepted, response_model_exclude_none=True)
async def load(
    job_id: str,
    body: LoadBody,
    jobs: JobsDep,
    tenancy: TenancyDep,
    tenant: TenantDep,
    turn: TurnDep,
    wait: float = 0.0,
) -> dict | Response:
    """A ``source_job_id`` of another tenant is answered as an unknown one (404), before anything is queued."""
    job = jobs.live(job_id)
    request_id = submit_load(jobs, job, body, load_target(job, body), tenant=tenant)
    return await with_answer(jobs, {"request_id": request_id, "job_id": job_id}, wait, turn)


# --- the same two routes, dispatched without FastAPI ----------------------------------------------
def _wait(request: Request) -> float:
    try:
        return _SECONDS.validate_python(request.query_params.get("wait", 0.0))
    except ValidationError as exc:  # answered as FastAPI answers a bad query parameter
        raise RequestValidationError([{**e, "loc": ("query", "wait")} for e in exc.errors()]) from None


async def _json_body(request: Request, model: type[BaseModel]) -> Any:
    raw = await request.body()
    try:
        if len(raw) > CHECK_ON_LOOP_BYTES:  # its number arrays read as compact arrays, as the FastAPI routes read them
            return model.model_validate(await json_of(raw))
        return model.model_validate_json(raw) if raw else None
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None


def _answer(answer: dict | Response) -> Response:
    return answer if isinstance(answer, Response) else JSONResponse(answer)


async def _fast_forward_backward(request: Request) -> Response:
    async with request.app.state.sequencing.turn(request.scope) as turn:
        visible_job(request)
        job_id, sub_job_id = request.path_params["job_id"], request.query_params.get("sub_job_id")
        body, jobs = await frame_body(request), request.app.state.jobs
        return _answer(await forward_backward(job_id, body, jobs, turn, sub_job_id=sub_job_id, wait=_wait(request)))


async def _fast_step(request: Request) -> Response:
    async with request.app.state.sequencing.turn(request.scope) as turn:
        visible_job(request)
        body = await _json_body(request, StepBody)
        return _answer(
            await step(request.path_params["job_id"], request.app.state.jobs, turn, body, wait=_wait(request))
        )


STEP_ROUTES = [
    Route(f"{API_PREFIX}/{{job_id}}/forward-backward", _fast_forward_backward, methods=["POST"]),
    Route(f"{API_PREFIX}/{{job_id}}/step", _fast_step, methods=["POST"]),
]
