"""Create, list, read and cancel jobs."""

from __future__ import annotations

from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool

from icefloe.protocol import PayloadTooLargeError
from icefloe.service.limits import MAX_CREATE_JOB_BYTES
from icefloe.service.routes import JobsDep, TenancyDep, TenantDep, api_router
from icefloe.service.schemas import ExperimentRun, JobCreate, JobCreated, JobList, JobPublic

__all__ = ["router"]

router = api_router("jobs")


async def _bounded_create_body(request: Request) -> None:
    """413 for a create-job body over :data:`MAX_CREATE_JOB_BYTES`, before its model keeps its arrays as lists."""
    size = len(await request.body())
    if size > MAX_CREATE_JOB_BYTES:
        raise PayloadTooLargeError(
            f"the create-job body is {size} bytes; it is at most {MAX_CREATE_JOB_BYTES} bytes here: "
            "send the sub-job configs without data"
        )


_BOUNDED = [Depends(_bounded_create_body)]


@router.post("/", response_model=JobCreated, response_model_exclude_none=True, dependencies=_BOUNDED)
@router.post("", response_model=JobCreated, response_model_exclude_none=True, include_in_schema=False,
             dependencies=_BOUNDED)  # fmt: skip
async def create_job(
    body: JobCreate, database: str, schema: str, jobs: JobsDep, tenancy: TenancyDep, tenant: TenantDep
) -> dict:
    job_id = await run_in_threadpool(tenancy.create, jobs, body, tenant=tenant, database=database, schema=schema)
    return {"job_id": job_id, "warnings": jobs.public(job_id)["warnings"] or None}


@router.get("/", response_model=JobList)
@router.get("", response_model=JobList, include_in_schema=False)
async def list_jobs(jobs: JobsDep, tenancy: TenancyDep, tenant: TenantDep, status: str | None = None) -> dict:
    return {"jobs": jobs.list_public(status, owner=tenancy.owner_filter(tenant))}


@router.get("/{job_id}", response_model=JobPublic)
async def get_job(job_id: str, jobs: JobsDep) -> dict:
    return jobs.public(job_id)


@router.post("/{job_id}:cancel")
async def cancel_job(job_id: str, jobs: JobsDep) -> dict:
    return jobs.cancel(job_id)


@router.post("/{job_id}:heartbeat")
async def heartbeat(job_id: str, jobs: JobsDep) -> dict:
    """Renew the job's lease (icefloe extension): a job nobody calls for ``lease_ttl_s`` is cancelled."""
    return jobs.heartbeat(job_id)


@router.get("/{job_id}/experiment-run", response_model=ExperimentRun)
async def experiment_run(job_id: str, jobs: JobsDep) -> dict:
    return jobs.experiment_run(job_id)
