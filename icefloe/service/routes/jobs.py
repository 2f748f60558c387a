"""Create, list, read and cancel jobs."""

from __future__ import annotations

from fastapi.concurrency import run_in_threadpool

from icefloe.service.routes import JobsDep, TenancyDep, TenantDep, api_router
from icefloe.service.schemas import ExperimentRun, JobCreate, JobCreated, JobList, JobPublic

__all__ = ["router"]

router = api_router("jobs")


@router.post("/", response_model=JobCreated, response_model_exclude_none=True)
@router.post("", response_model=JobCreated, response_model_exclude_none=True, include_in_schema=False)
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
