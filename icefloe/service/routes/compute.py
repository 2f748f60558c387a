"""The data plane: forward-backward, forward, step, save, load, generate.

Octet bodies (DSSST1 frames or request chunks) are decoded on a thread-pool thread; JSON bodies
are validated by their models. Every route answers ``{request_id, job_id}`` (or
``{chunk_cached: true}`` for a non-final chunk) and the work runs on the sub-job's FIFO worker.
"""

from __future__ import annotations

from fastapi.concurrency import run_in_threadpool

from icefloe.protocol import OP_FORWARD, OP_FWD_BWD, OP_GENERATE
from icefloe.service.deps import JobsDep, OctetBody
from icefloe.service.errors import bad_request
from icefloe.service.models import LoadBody, RequestAccepted, SaveBody, StepBody
from icefloe.service.operations import (
    load_target,
    submit_frame,
    submit_load,
    submit_save,
    submit_step,
)
from icefloe.service.routes.common import api_router
from icefloe.service.streams import submit_generate_stream

__all__ = ["router"]

router = api_router("compute")


@router.post("/{job_id}/forward-backward")
async def forward_backward(job_id: str, body: OctetBody, jobs: JobsDep, sub_job_id: str | None = None) -> dict:
    job = jobs.live(job_id)
    target = jobs.resolve_sub_job(job, sub_job_id=sub_job_id, sub_job_type=None, default_type="training")
    return await run_in_threadpool(submit_frame, jobs, job, OP_FWD_BWD, body, sub_job_id=target)


@router.post("/{job_id}/forward")
async def forward(
    job_id: str, body: OctetBody, jobs: JobsDep, sub_job_id: str | None = None, sub_job_type: str | None = None
) -> dict:
    job = jobs.live(job_id)
    target = jobs.resolve_sub_job(job, sub_job_id=sub_job_id, sub_job_type=sub_job_type, default_type="training")
    if job.specs[target].job_type == "sampling":
        raise bad_request(f"forward runs on a training or log_probability sub-job; {target} is a sampling sub-job")
    return await run_in_threadpool(submit_frame, jobs, job, OP_FORWARD, body, sub_job_id=target)


@router.post("/{job_id}/generate")
async def generate(job_id: str, body: OctetBody, jobs: JobsDep, sub_job_id: str | None = None) -> dict:
    job = jobs.live(job_id)
    if sub_job_id is not None:  # else the body's routing_key picks the sampling sub-job
        jobs.resolve_sub_job(job, sub_job_id=sub_job_id, sub_job_type="sampling", default_type="sampling")
    return await run_in_threadpool(submit_frame, jobs, job, OP_GENERATE, body, sub_job_id=sub_job_id)


@router.post("/{job_id}/generate-stream")
async def generate_stream(job_id: str, body: OctetBody, jobs: JobsDep, sub_job_id: str | None = None) -> dict:
    """UTF-8 JSON sent as octet-stream; results are drained from the request's events as they finish."""
    job = jobs.live(job_id)
    if sub_job_id is not None:
        jobs.resolve_sub_job(job, sub_job_id=sub_job_id, sub_job_type="sampling", default_type="sampling")
    return await run_in_threadpool(submit_generate_stream, jobs, job, body, sub_job_id=sub_job_id)


@router.post("/{job_id}/step", response_model=RequestAccepted)
async def step(job_id: str, jobs: JobsDep, body: StepBody | None = None) -> dict:
    job = jobs.live(job_id)
    target = jobs.resolve_sub_job(job, sub_job_id=None, sub_job_type=None, default_type="training")
    return {"request_id": submit_step(jobs, job, body or StepBody(), target), "job_id": job_id}


@router.post("/{job_id}/save", response_model=RequestAccepted)
async def save(job_id: str, jobs: JobsDep, body: SaveBody | None = None) -> dict:
    job = jobs.live(job_id)
    target = jobs.resolve_sub_job(job, sub_job_id=None, sub_job_type=None, default_type="training")
    return {"request_id": submit_save(jobs, job, body or SaveBody(), target), "job_id": job_id}


@router.post("/{job_id}/load", response_model=RequestAccepted)
async def load(job_id: str, body: LoadBody, jobs: JobsDep) -> dict:
    job = jobs.live(job_id)
    target = load_target(job, body)
    return {"request_id": submit_load(jobs, job, body, target), "job_id": job_id}
