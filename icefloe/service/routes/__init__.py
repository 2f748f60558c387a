"""One APIRouter per resource, each under the training API's path prefix, and the dependencies
routes name in their signatures. A route of the prefix takes a numbered POST's turn first
(:data:`TurnDep`, the ``Icefloe-Sequence`` order), then answers 404 for a ``{job_id}`` of another
tenant before it runs (:func:`visible_job`).

Every dependency is ``async def``: FastAPI runs a plain ``def`` dependency on its thread pool, and
that hop alone cost about a millisecond per call on a loaded machine. The bearer token is checked
before any route runs, before any body is read (:class:`icefloe.service.middleware.RequireToken`).
A JSON body is read by :func:`icefloe.wire.dense_json.loads` (:func:`json_of`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.routing import APIRoute

from icefloe.service.jobs import JobManager
from icefloe.service.limits import CHECK_ON_LOOP_BYTES, MAX_JSON_BYTES, check_frame_header_length
from icefloe.service.middleware import read_body, tenant_of
from icefloe.service.sequencing import Turn
from icefloe.service.settings import ServeSettings
from icefloe.service.store import Database
from icefloe.service.tenants import Tenancy
from icefloe.wire import dense_json

__all__ = [
    "API_PREFIX",
    "DenseJsonRoute",
    "JobsDep",
    "JsonOctetBody",
    "OctetBody",
    "SettingsDep",
    "StoreDep",
    "TenancyDep",
    "TenantDep",
    "TurnDep",
    "api_router",
    "frame_body",
    "json_of",
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


async def _turn(request: Request) -> AsyncIterator[Turn]:
    """The request's turn in its ``Icefloe-Sequence`` session, held until the route returns or raises."""
    async with request.app.state.sequencing.turn(request.scope) as turn:
        yield turn


# scope="function": the turn is given up when the route returns, before its answer is sent
TurnDep = Annotated[Turn, Depends(_turn, scope="function")]


async def json_of(raw: bytes) -> Any:
    """A JSON body as :func:`dense_json.loads` reads it, off the event loop when it is large."""
    return await asyncio.to_thread(dense_json.loads, raw) if len(raw) > CHECK_ON_LOOP_BYTES else dense_json.loads(raw)


class _DenseJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = await json_of(await self.body())
        return self._json


class DenseJsonRoute(APIRoute):
    """A route whose JSON body FastAPI reads with :func:`json_of`: a large body's number arrays are
    ``array.array`` s (a model's typed fields read them as lists), never Python numbers."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handle = super().get_route_handler()

        async def dense(request: Request) -> Response:
            return await handle(_DenseJsonRequest(request.scope, request.receive))

        return dense


def api_router(tag: str) -> APIRouter:
    """A router under the training-API prefix: a numbered POST waits for its turn, and the ``{job_id}``
    routes are the caller's tenant's only."""
    return APIRouter(
        prefix=API_PREFIX,
        tags=[tag],
        dependencies=[Depends(_turn, scope="function"), Depends(_visible_job)],
        route_class=DenseJsonRoute,
    )


def _app_state(name: str) -> Callable[[Request], Awaitable[Any]]:
    async def read(request: Request) -> Any:
        return getattr(request.app.state, name)

    return read


async def _tenant(request: Request) -> str:
    return tenant_of(request.scope)


async def frame_body(request: Request) -> bytes:
    """A DSSST1 frame's bytes; one whose first 8 bytes declare too large a header is refused (413)
    once it was read and dropped, never kept. The POST cap is enforced outside (middleware.BodyLimit)."""
    declared = request.headers.get("content-length", "")
    body = await read_body(
        request.receive,
        head_bytes=8,
        check_head=check_frame_header_length,
        drain=True,
        declared=int(declared) if declared.isdigit() else None,
    )
    return b"" if body is None else body


async def _json_octet_body(request: Request) -> bytes:
    """JSON sent as octet-stream: capped as any JSON body is, since it is parsed whole."""
    body = await read_body(request.receive, MAX_JSON_BYTES, drain=True)
    return b"" if body is None else body


SettingsDep = Annotated[ServeSettings, Depends(_app_state("settings"))]
JobsDep = Annotated[JobManager, Depends(_app_state("jobs"))]
StoreDep = Annotated[Database, Depends(_app_state("db"))]
TenancyDep = Annotated[Tenancy, Depends(_app_state("tenancy"))]
TenantDep = Annotated[str, Depends(_tenant)]
OctetBody = Annotated[bytes, Depends(frame_body)]
JsonOctetBody = Annotated[bytes, Depends(_json_octet_body)]
