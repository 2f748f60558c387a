"""Named dependencies, so a route's signature lists what it needs.

Every dependency is ``async def``: FastAPI runs a plain ``def`` dependency on its thread pool,
and that hop alone cost about a millisecond per call on a loaded machine. The bearer token is
not one of them: :class:`icefloe.service.middleware.RequireToken` checks it before any body is read.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import Depends, Request

from icefloe.service.jobs import JobManager
from icefloe.service.settings import ServeSettings
from icefloe.service.store import Database

__all__ = ["JobsDep", "OctetBody", "SettingsDep", "StoreDep"]


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
