"""One APIRouter per resource, each under the training API's path prefix, and the dependencies
routes name in their signatures. A route of the prefix that names a ``{job_id}`` answers 404 for
a job of another tenant before it runs (:func:`visible_job`).

Every dependency is ``async def``: FastAPI runs a plain ``def`` dependency on its thread pool, and
that hop alone cost about a millisecond per call on a loaded machine. The bearer token is checked
before any route runs, before any body is read (:class:`icefloe.service.middleware.RequireToken`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from icefloe.service.jobs import JobManager
from icefloe.service.middleware import tenant_of
from icefloe.service.settings import ServeSettings
from icefloe.service.store import Database
from icefloe.service.tenants import Tenancy

__all__ = [
    "API_PREFIX",
    "JobsDep",
    "OctetBody",
    "SettingsDep",
    "StoreDep",
    "TenancyDep",
    "TenantDep",
    "api_router",
    "visible_job",
]

# Any database / schema / endpoint names are accepted: one service answers for all of them.
API_PREFIX = "/api/v2/databases/{database}/schemas/{schema}/{endpoint}"


def visible_job(request: Request) -> None:
    """404 when the request's ``{job_id}`` is a job its tenant may not see."""
    job_id = request.path_params.get("job_id")
    if job_id is not None:
        request.app.state.tenancy.check(tenant_of(request.scope), job_id)


async def _visible_job(request: Request) -> None:
    visible_job(request)


def api_router(tag: str) -> APIRouter:
    """A router under the training-API prefix; its ``{job_id}`` routes are the caller's tenant's only."""
    return APIRouter(prefix=API_PREFIX, tags=[tag], dependencies=[Depends(_visible_job)])


def _app_state(name: str) -> Callable[[Request], Awaitable[Any]]:
    async def read(request: Request) -> Any:
        return getattr(request.app.state, name)

    return read


async def _tenant(request: Request) -> str:
    return tenant_of(request.scope)


async def _octet_body(request: Request) -> bytes:
    return await request.body()  # the size cap is enforced while reading (see middleware.BodyLimit)


SettingsDep = Annotated[ServeSettings, Depends(_app_state("settings"))]
JobsDep = Annotated[JobManager, Depends(_app_state("jobs"))]
StoreDep = Annotated[Database, Depends(_app_state("db"))]
TenancyDep = Annotated[Tenancy, Depends(_app_state("tenancy"))]
TenantDep = Annotated[str, Depends(_tenant)]
OctetBody = Annotated[bytes, Depends(_octet_body)]
