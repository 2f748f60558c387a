"""Per-step job metrics (icefloe extension) and the service's Prometheus metrics.

``POST {job}/metrics`` takes ``{"step": int, "metrics": {name: number}}`` from the client (reward
and other scalars only it knows), up to the job's bounds (409 past them); ``GET {job}/metrics?after_step=``
answers a page of the job's series, one point per step with the engine's values and the client's merged,
and the ``next_after_step`` to ask for next (None at the end). ``GET /metrics`` is the Prometheus text format;
it needs the token like the API unless the service runs with ``--metrics-public``. It is service-wide
(its series name jobs), so on a server with named tenants only the ``admin`` tenant reads it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from fastapi import APIRouter, Body, Query, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from icefloe.protocol import MAX_METRIC_STEP, NotFoundError
from icefloe.service.jobs import JobManager
from icefloe.service.metrics import check_reported
from icefloe.service.routes import JobsDep, SettingsDep, TenantDep, api_router
from icefloe.service.settings import ADMIN_TENANT

__all__ = ["prometheus_router", "router"]

router = api_router("metrics")
prometheus_router = APIRouter(tags=["metrics"])


@router.post("/{job_id}/metrics")
async def report_metrics(job_id: str, jobs: JobsDep, body: dict[str, Any] = Body(...)) -> dict:
    jobs.row(job_id)  # 404 for an unknown job
    jobs.renew(job_id)  # the client reporting is alive
    step, values = check_reported(body)
    await asyncio.to_thread(jobs.metrics.report, job_id, step, values)  # reads the job's counts, then writes
    return {"job_id": job_id, "step": step, "recorded": sorted(values)}


@router.get("/{job_id}/metrics")
async def job_metrics(job_id: str, jobs: JobsDep, after_step: int = Query(-1, ge=-1, le=MAX_METRIC_STEP)) -> Response:
    jobs.row(job_id)  # 404 for an unknown job; a read, so no lease renewal
    return Response(await asyncio.to_thread(_series_page, jobs, job_id, after_step), media_type="application/json")


def _series_page(jobs: JobManager, job_id: str, after_step: int) -> bytes:
    """One page of the job's series as JSON, read and written on a worker thread: a page holds up to
    ``metrics.SERIES_PAGE_VALUES`` values, too many to build on the event loop."""
    points, next_after_step = jobs.metrics.page(job_id, after_step)
    return orjson.dumps({"job_id": job_id, "points": points, "next_after_step": next_after_step})


@prometheus_router.get("/metrics")
async def prometheus(jobs: JobsDep, settings: SettingsDep, tenant: TenantDep) -> Response:
    if settings.tenant_tokens and tenant != ADMIN_TENANT and not settings.metrics_public:
        raise NotFoundError(
            "GET /metrics is service-wide, so only the admin tenant reads it here; read a job's own series at "
            "GET {prefix}/{job_id}/metrics"
        )
    return Response(generate_latest(jobs.metrics.registry), media_type=CONTENT_TYPE_LATEST)
