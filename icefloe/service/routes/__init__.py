"""One APIRouter per resource, each under the training API's path prefix, and the dependencies
routes name in their signatures.

Every dependency is ``async def``: FastAPI runs a plain ``def`` dependency on its thread pool, and
that hop alone cost about a millisecond per call on a loaded machine. The bearer token is checked
before any route runs, before any body is read (:class:`icefloe.service.middleware.RequireToken`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from icefloe.service.jobs import JobManager
from icefloe.service.settings import ServeSettings
from icefloe.service.store import Database

__all__ = ["API_PREFIX", "JobsDep", "OctetBody", "SettingsDep", "StoreDep", "api_router"]

# Any database / schema / endpoint names are accepted: one service answers for all of them.
API_PREFIX = "/api/v2/databases/{database}/schemas/{schema}/{endpoint}"


def api_router(tag: str) -> APIRouter:
    """A router under the training-API prefix."""
    return APIRouter(prefix=API_PREFIX, tags=[tag])


def _app_state(name: str) -> Callable[[Request], Awaitable[Any]]:
    async def read(request: Request) -> Any:
        return getattr(request.app.state, name)

    return read


async def _octet_body(request: Request) -> bytes:
    return await request.body()  # the size cap is enforced while reading (see middleware.BodyLimit)


SettingsDep = Annotated[ServeSettings, Depends(_app_state("settings"))]
JobsDep = Annotated[JobManager, Depends(_app_state("jobs"))]
StoreDep = Annotated[Database, Depends(_app_state("db"))]
OctetBody = Annotated[bytes, Depends(_octet_body)]
